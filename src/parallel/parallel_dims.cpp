// resolve_parallel_dims: the one place where the degrees and ZeRO options are checked against
// each other and the world.
#include "polytrain/parallel/parallel_dims.h"

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

#include <algorithm>
#include <regex>

namespace polytrain {

using detail::cat;

std::string ParallelDims::describe() const {
  std::string s = cat("tp ", tp, " x dp ", dp);
  if (pp > 1) s = cat("pp ", pp, virtual_stages > 1 ? cat(" (", virtual_stages, " virtual)") : std::string(), " x ", s);
  if (strategy == DpStrategy::kZero) {
    s += cat(", ZeRO-", zero_stage);
    if (offload_optimizer) s += " + offload_optimizer";
  } else if (strategy == DpStrategy::kSwarm) {
    s = "swarm";
  } else if (strategy == DpStrategy::kReplicate) {
    s += ", replicated optimizer";
  }
  return s;
}

std::string model_parallel_error(const std::string& env_type, int64_t model_parallel_size, int64_t world) {
  if (model_parallel_size < 1) return cat("trainer.model_parallel_size must be >= 1, got ", model_parallel_size);
  if (model_parallel_size > 1 && env_type != "deepspeed+mpu")
    return cat("trainer.model_parallel_size is ", model_parallel_size,
               ": tensor parallelism needs env_type 'deepspeed+mpu', not '", env_type, "'");
  if (world >= 1 && world % model_parallel_size != 0)
    return cat("trainer.model_parallel_size (", model_parallel_size, ") does not divide the world size (", world,
               "): world = model_parallel_size x data-parallel size");
  return "";
}

std::string pipeline_parallel_error(const std::string& env_type, int64_t pp, int64_t tp, int64_t world) {
  if (pp < 1) return cat("trainer.pipeline_parallel_size must be >= 1, got ", pp);
  if (pp > 1 && env_type != "pytorchDDP" && env_type != "deepspeed" && env_type != "deepspeed+mpu")
    return cat("trainer.pipeline_parallel_size is ", pp, ": pipeline parallelism needs env_type pytorchDDP, deepspeed or "
               "deepspeed+mpu, not '", env_type, "'");
  if (world >= 1 && world % (pp * std::max<int64_t>(tp, 1)) != 0)
    return tp > 1 ? cat("model_parallel_size (", tp, ") x pipeline_parallel_size (", pp, ") = ", tp * pp,
                        " does not divide the world size (", world, ")")
                  : cat("trainer.pipeline_parallel_size (", pp, ") does not divide the world size (", world,
                        "): world = pipeline_parallel_size x data-parallel size");
  return "";
}

std::string pipeline_partition_error(const std::string& partition) {
  if (partition == "parameters" || partition == "uniform") return "";
  if (partition.rfind("type:", 0) != 0)
    return cat("must be 'parameters', 'uniform' or 'type:REGEX' (DeepSpeed's partition_method), got '", partition, "'");
  try {
    std::regex(partition.substr(5), std::regex::icase);
  } catch (const std::regex_error& e) {
    return cat("'", partition, "': the pattern after 'type:' is not a regular expression (", e.what(), ")");
  }
  return "";
}

ParallelDims resolve_parallel_dims(const Config& cfg, int64_t world) {
  const auto& t = cfg.trainer;
  const auto& z = cfg.zero_optimization;
  ParallelDims d;
  d.preset = t.env_type;
  d.world = world;
  PT_INPUT_CHECK(world >= 1, "world size must be >= 1, got ", world);
  const std::string mp_error = model_parallel_error(t.env_type, t.model_parallel_size, world);
  PT_INPUT_CHECK(mp_error.empty(), mp_error);
  const bool zero_preset = t.env_type == "deepspeed" || t.env_type == "deepspeed+mpu";
  if (t.env_type == "pytorch") {
    PT_INPUT_CHECK(world == 1, "env_type pytorch runs one process, but the world has ", world,
                   " (use pytorchDDP or deepspeed for data parallelism)");
    d.strategy = DpStrategy::kNone;
  } else if (t.env_type == "pytorchDDP") {
    d.strategy = DpStrategy::kReplicate;
  } else if (t.env_type == "hivemind") {
    d.strategy = DpStrategy::kSwarm;
  } else if (zero_preset) {
    d.tp = t.model_parallel_size;
    d.zero_stage = z.stage;
    PT_INPUT_CHECK(z.stage >= 0 && z.stage <= 3, "zero_optimization.stage ", z.stage, " is not a ZeRO stage (0, 1, 2, 3)");
    PT_INPUT_CHECK(z.offload_optimizer.device != "nvme", "zero_optimization.offload_optimizer.device 'nvme' is not "
                                                         "available in this build; use 'cpu' or 'none'");
    d.offload_optimizer = z.offload_optimizer.device == "cpu";
    PT_INPUT_CHECK(!d.offload_optimizer || z.stage >= 1, "zero_optimization.offload_optimizer needs stage 1, 2 or 3, got stage ",
                   z.stage);
    PT_INPUT_CHECK(z.offload_param.device != "nvme", "zero_optimization.offload_param.device 'nvme' is not available in "
                                                     "this build; use 'cpu' or 'none'");
    PT_INPUT_CHECK(z.offload_param.device == "none" || z.stage == 3, "zero_optimization.offload_param needs stage 3, got stage ",
                   z.stage);
    // deepspeed+mpu at stage 0 is Megatron's own data parallelism (bucketed all-reduce of each
    // rank's parts); from stage 1 the optimizer state is partitioned over the dp group.
    d.strategy = t.env_type == "deepspeed+mpu" && z.stage == 0 ? DpStrategy::kReplicate : DpStrategy::kZero;
  } else {
    throw InputError("trainer.env_type: unknown value '" + t.env_type +
                     "' (expected pytorch, pytorchDDP, deepspeed, deepspeed+mpu or hivemind)");
  }
  const std::string pp_error = pipeline_parallel_error(t.env_type, t.pipeline_parallel_size, d.tp, world);
  PT_INPUT_CHECK(pp_error.empty(), pp_error);
  d.pp = t.pipeline_parallel_size;
  d.virtual_stages = cfg.pipeline.virtual_stages;
  PT_INPUT_CHECK(d.pp == 1 || d.zero_stage < 3, "zero_optimization.stage 3 partitions the parameters of every layer; "
                 "with trainer.pipeline_parallel_size ", d.pp, " use stage 0, 1 or 2 (each stage's parameters are "
                 "already its own)");
  PT_INPUT_CHECK(d.pp == 1 || cfg.pipeline.schedule != "zbh1" || d.zero_stage < 2 || d.strategy != DpStrategy::kZero,
                 "pipeline.schedule zbh1 splits each backward in two and runs the weight half itself; "
                 "zero_optimization.stage ", d.zero_stage, " reduces gradients from the strategy's own backward: use stage 0 or 1");
  PT_INPUT_CHECK(d.pp > 1 || d.virtual_stages == 1, "pipeline.virtual_stages (", d.virtual_stages,
                 ") needs trainer.pipeline_parallel_size > 1");
  d.dp = world / (d.tp * d.pp);
  return d;
}

}  // namespace polytrain
