// ParallelDims: every degree of parallelism of a job in one struct, resolved and checked once
// from the config and the world (torchtitan's ParallelDims). env_type is a preset that fills
// it (FlagAI's names):
//   pytorch        everything 1
//   pytorchDDP     dp = world
//   deepspeed      dp = world, the ZeRO stage and offload from zero_optimization
//   deepspeed+mpu  tp = model_parallel_size, dp = world / tp, the ZeRO stage and offload
//   hivemind       the swarm's data parallelism (dp is the swarm, not a fixed world)
// The job is then built in a fixed order: model transforms (the TP plan), then exactly one
// data-parallel strategy over the dp group (replicate = bucketed all-reduce, ZeRO-1/2, swarm).
// Torch-free: the arithmetic and the checks are tested without a model.
#pragma once

#include <cstdint>
#include <string>

namespace polytrain {

struct Config;

/// The data-parallel strategy a job runs over its dp group.
enum class DpStrategy {
  kNone,       ///< one process (pytorch)
  kReplicate,  ///< every rank holds the whole optimizer state; gradients all-reduced in buckets
  kZero,       ///< ZeRO stage 1/2 (stage 0: DeepSpeed's engine without partitioning)
  kSwarm,      ///< hivemind's decentralized averaging
};

struct ParallelDims {
  std::string preset = "pytorch";  ///< the env_type that filled it
  int64_t world = 1;
  int64_t tp = 1;  ///< tensor-parallel degree (Megatron order: TP ranks adjacent)
  int64_t pp = 1;  ///< pipeline degree (Megatron order: pipeline stages outermost)
  int64_t dp = 1;  ///< data-parallel degree: world / (tp x pp)
  int64_t virtual_stages = 1;  ///< model chunks per pipeline stage (interleaved 1F1B above 1)
  int zero_stage = 0;
  bool offload_optimizer = false;
  bool offload_param = false;
  DpStrategy strategy = DpStrategy::kNone;

  bool tp_enabled() const { return tp > 1; }
  /// "tp 2 x dp 2, ZeRO-2 + offload_optimizer" (the first line of a multi-rank run).
  std::string describe() const;
};

/// The dims of `cfg` on `world` processes. InputError, one line naming the keys and numbers,
/// for anything that does not fit together: model_parallel_size not dividing the world or set
/// without deepspeed+mpu, a ZeRO stage that is not built, offload without a stage that
/// partitions, offload to nvme.
ParallelDims resolve_parallel_dims(const Config& cfg, int64_t world);

/// Why trainer.model_parallel_size does not fit `env_type` and `world` (one line naming the key
/// and the numbers), or "" when it does; a `world` < 1 is not known yet (the divisibility waits).
/// The one home of these rules: the config parser, resolve_parallel_dims and the process grid
/// all ask it.
std::string model_parallel_error(const std::string& env_type, int64_t model_parallel_size, int64_t world);

/// Why trainer.pipeline_parallel_size does not fit `env_type`, the tensor-parallel size and
/// `world` (one line naming the key and the numbers), or ""; a `world` < 1 is not known yet.
std::string pipeline_parallel_error(const std::string& env_type, int64_t pipeline_parallel_size,
                                    int64_t model_parallel_size, int64_t world);

/// Why `partition` is not one of "parameters", "uniform", "type:REGEX" (a valid regex), or "".
std::string pipeline_partition_error(const std::string& partition);

}  // namespace polytrain
