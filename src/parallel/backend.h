// The one interface every env_type implements (principle 1): prepare, data shard, backward,
// ready-to-step, step, reduce metric, state. The Trainer loop talks only to this; only
// backend_factory.cpp knows the concrete backends.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/config.h"

#include "common/torch_fwd.h"

namespace polytrain {

/// Where this process sits in the job.
struct RankContext {
  int64_t rank = 0;        ///< global rank
  int64_t world_size = 1;  ///< all processes
  int64_t local_rank = 0;
  int64_t dp_rank = 0;     ///< data-parallel rank: which share of each global batch it reads
  int64_t dp_size = 1;     ///< data-parallel size
  c10::Device device = c10::Device(c10::kCPU);
  bool is_main() const { return rank == 0; }
};

/// What step() did.
struct StepResult {
  bool applied = true;     ///< false: update skipped (non-finite gradients), on every rank
  double grad_norm = 0.0;  ///< global L2 norm of the gradients before clipping
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual const RankContext& context() const = 0;

  /// Wraps, replaces or shards the model in place and builds the optimizer over what this
  /// rank owns. Called once, before any state is loaded.
  virtual void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) = 0;

  /// Micro-batches this rank runs before the global batch is complete (fixed for DDP/ZeRO/TP;
  /// the decentralized backend will decide from the swarm's progress instead).
  virtual bool ready_to_step(int64_t micro_steps_done) const = 0;

  /// Backward of one micro-batch's loss, already divided by the accumulation count.
  virtual void backward(const at::Tensor& loss) = 0;

  /// Reduces gradients if needed, divides them by `loss_scale` (the fp16 loss scale the loss
  /// was multiplied by; 1 otherwise), checks they are finite, clips by the global norm
  /// (`gradient_clipping`, 0 = off), applies lr/beta1 and updates. Gradients are cleared after.
  virtual StepResult step(double lr, std::optional<double> beta1, double loss_scale) = 0;

  /// The global value of a logged number (mean over data-parallel ranks).
  virtual double reduce_metric(double local_value) = 0;

  /// Optimizer (and backend-specific) state; the model is saved by the checkpoint code.
  virtual void save_state(torch::serialize::OutputArchive& archive) = 0;
  virtual void load_state(torch::serialize::InputArchive& archive) = 0;

  virtual torch::optim::Optimizer& optimizer() = 0;
};

/// The one factory mapping env_type to a backend. InputError for an env_type that is not
/// built yet or unknown.
std::unique_ptr<Backend> make_backend(const Config& cfg);

}  // namespace polytrain
