// The line a run prints before its first step, and the same facts as a metrics.jsonl record:
// env_type, the grid, ZeRO stage and offload, the communication engine, parameters, tokens per
// step, and where the run writes. The Trainer gathers the facts (run_facts needs the backend
// prepared and the experiment folder open); printing and recording are the metric sinks'.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"
#include "polytrain/common/torch_fwd.h"
#include "polytrain/parallel/backend.h"

namespace polytrain {

class BatchSource;

struct RunFacts {
  std::string env_type;
  RankContext ctx;
  bool swarm = false;             ///< no fixed world: the grid is the swarm's
  int64_t global_batch = 0;       ///< samples per optimizer step (a swarm's target)
  int64_t tokens_per_sample = 0;  ///< 0: the data has no input_ids
  int64_t parameters = 0;
  int zero_stage = -1;            ///< -1: not a ZeRO env_type
  std::string offload_optimizer;  ///< "none", "cpu"
  std::string offload_param;      ///< stage 3: "none", "cpu"
  std::string comm;               ///< gloo, mpi, nccl, or what a single process / swarm uses
  std::string experiment_dir;
  bool continued = false;         ///< the experiment folder of the run this one resumes
  std::string save_dir;
  std::string tensorboard_dir;
};

/// "run: env_type ... | world 2 = tp 1 x pp 1 x dp 2 | ZeRO stage 2, offload_optimizer cpu | comm gloo | ..."
std::string run_summary_line(const RunFacts& f);
/// {"step": step, "run": {...}} for metrics.jsonl.
nlohmann::json run_summary_record(const RunFacts& f, int64_t step);

/// Each parameter once (tied weights are one tensor in two modules).
int64_t count_parameters(torch::nn::Module& model);
/// input_ids' length of one training sample (T5: the encoder's input); 0 without input_ids.
int64_t tokens_per_sample(const BatchSource& data);
/// The backend's collective library, or what stands for one (one process, a swarm), for the summary.
std::string comm_engine(const Config& cfg, const Backend& backend);

}  // namespace polytrain
