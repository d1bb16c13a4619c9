// The optimizer registry: one entry per optimizer a config can name, and the only place that
// knows the list. Everything that depends on the optimizer asks the entry: the config's checks
// (which statistics a swarm may average, whether a schedule may cycle beta1), the factory the
// backends build it with, and whether ZeRO can partition its state by element.
//
// Adding an optimizer = one entry in optimizer_registry.cpp (its name, statistics, flags and a
// factory returning a polytrain::Optimizer, optimizers.h) and nothing else.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace polytrain {

class Optimizer;
struct OptimizerConfig;
struct ParamGroup;

struct OptimizerEntry {
  /// The name in `optimizer.type` (matched case-insensitively), as DeepSpeed / torch.optim spell it.
  const char* name;
  /// The per-parameter state tensors it keeps under `cfg`, by torch.optim's names ("exp_avg",
  /// "momentum_buffer", ...): what a swarm may average and what a checkpoint holds.
  std::vector<std::string> (*statistics)(const OptimizerConfig& cfg);
  /// ZeRO can partition its state by element (an element-wise update, as Adam's): a partition
  /// boundary may cut a parameter anywhere. False for layer-wise updates (LAMB's trust ratio).
  bool shardable;
  /// It has a momentum coefficient beta1 that a schedule (OneCycle) may cycle.
  bool has_beta1;
  /// Builds it over the parameter groups; InputError naming the optimizer.params key for bad
  /// hyperparameters.
  std::unique_ptr<Optimizer> (*make)(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);
  /// Why ZeRO cannot shard it (shown when shardable is false).
  const char* not_shardable_because = "";
};

/// Every optimizer, in the order the messages list them.
const std::vector<OptimizerEntry>& optimizer_registry();

/// The entry for `type` (case-insensitive), or nullptr.
const OptimizerEntry* find_optimizer(const std::string& type);

/// The entry for `type`; InputError "optimizer.type: unknown optimizer ... (known: ...)".
const OptimizerEntry& optimizer_entry(const std::string& type);

}  // namespace polytrain
