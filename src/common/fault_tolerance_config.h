// trainer.fault_tolerance: whether a data-parallel job survives the loss of ranks
// (docs/fault_tolerance.md). Given as `true` / `false` or as an object
// {"enabled": true, "min_world_size": N, "quorum_wait": SECONDS}; the --fault_tolerance and --min_world_size flags set the
// same keys. No typed field holds it: config_from_json accepts the key and keeps it in
// Config::source, and the functions here check and read it.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

struct Config;

struct FaultToleranceOptions {
  bool enabled = false;
  /// Fewest ranks the job goes on with; below it the job stops, naming the lost ranks.
  int64_t min_world_size = 1;
  /// Seconds the survivors' quorum waits for survivors still computing when the others failed
  /// (one that registers later is left out).
  double quorum_wait = 2.0;
};

/// Parses a trainer.fault_tolerance value; InputError naming `origin` and the key otherwise.
FaultToleranceOptions parse_fault_tolerance(const nlohmann::json& value, const std::string& origin);

/// Checks the block of a parsed config (InputError naming `origin`) and, when it is on, resolves
/// trainer.comm_backend: "auto" becomes gloo, mpi and nccl are refused, as is a CUDA device.
void resolve_fault_tolerance(Config& cfg, const std::string& origin);

/// The options of a parsed config (disabled when the key is absent).
FaultToleranceOptions fault_tolerance_options(const Config& cfg);

/// launch's per-rank restart count of a replacement for a lost rank (POLYTRAIN_FT_JOIN), 0 in
/// any other process; InputError when the variable is no count.
int64_t replacement_attempt();

}  // namespace polytrain
