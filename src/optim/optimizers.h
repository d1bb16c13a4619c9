// polytrain's Optimizer interface (what every backend steps: whole parameters for pytorch /
// pytorchDDP, flat fp32 partitions for ZeRO, local shards for tensor parallelism) and the
// adapters over libtorch's optimizers and Lamb, built from the config with the usual no-decay
// group. Which LR to set when is lr_schedule.h's business; calling step() is the backend's.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

namespace polytrain {

struct OptimizerConfig;

using NamedParams = std::vector<std::pair<std::string, torch::Tensor>>;

/// One parameter group: its tensors by name and its weight decay.
struct ParamGroup {
  NamedParams params;
  double weight_decay = 0.0;
};

/// Splits trainable parameters into the decayed group (weight_decay = cfg.weight_decay) and the
/// exempt group (names containing any cfg.no_decay substring: biases, LayerNorm weights; decay 0),
/// in that order, leaving out an empty group. A tensor listed twice (tied weights) is kept once,
/// under its first name; tensors that do not require grad are left out. InputError when nothing
/// is trainable. Usable on its own: ZeRO flattens each group into its own partitioned buffer.
std::vector<ParamGroup> split_by_decay(const OptimizerConfig& cfg, const NamedParams& named_params);

/// What a backend steps. Parameters are those given at construction (whole tensors, or a
/// backend's partitions of them); state is saved and loaded by parameter name, so a backend
/// that re-partitions can map it.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  /// The config's type name ("AdamW", "SGD", ...), for messages.
  virtual std::string name() const = 0;
  /// One update from the parameters' .grad (parameters without a gradient are left alone).
  virtual void step() = 0;
  /// Clears gradients (zeroes them in place: backends keep .grad as views of flat buffers).
  virtual void zero_grad() = 0;
  virtual void set_lr(double lr) = 0;
  /// Whether set_beta1 is meaningful (Adam, AdamW, Lamb).
  virtual bool has_beta1() const = 0;
  /// Sets beta1 of every group, keeping beta2 (OneCycle's momentum). InputError when the
  /// optimizer has no beta1 or beta1 is outside [0, 1).
  virtual void set_beta1(double beta1) = 0;
  /// State by parameter name: the archive holds the names and each parameter's state.
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  /// InputError naming the parameter when a saved state does not fit (missing, other shape).
  virtual void load(torch::serialize::InputArchive& archive, const std::string& origin) = 0;
  /// The statistic `name` (one of optimizer_statistics(): "exp_avg", "exp_avg_sq", ...) of
  /// parameter `param`, sharing the optimizer's storage (writing it changes the state), except
  /// for the 8-bit optimizers (optimizers_8bit.h), which return a dequantized fp32 copy: write
  /// through set_statistic to be sure. Undefined before the parameter's first update.
  /// InputError for a name this optimizer does not keep.
  virtual at::Tensor statistic(const at::Tensor& param, const std::string& name);
  /// Sets statistic `name` of `param` to `value` (the parameter's shape), as a swarm does after
  /// averaging it. The default copies into statistic()'s storage (nothing to do when `value`
  /// is that storage); the 8-bit optimizers requantize. InputError as statistic();
  /// InternalError before the parameter's first update.
  virtual void set_statistic(const at::Tensor& param, const std::string& name, const at::Tensor& value);
  /// Bytes of per-parameter state held between steps (moments, quantization codes and scales,
  /// scratch kept for the next step). InternalError where an optimizer does not count them.
  virtual int64_t state_bytes() const;
  /// The libtorch optimizer underneath, for code that needs it (golden tests).
  virtual torch::optim::Optimizer& torch_optimizer() = 0;
};

/// The Optimizer for cfg.type over `groups` (from split_by_decay, or a backend's partitions),
/// built by its registry entry's factory (optimizer_registry.h):
///   "AdamW", or "Adam" with adam_w_mode -> torch::optim::AdamW (decoupled decay)
///   "Adam" with adam_w_mode=false       -> torch::optim::Adam (L2 decay added to the gradient)
///   "SGD" -> torch::optim::SGD, "Adagrad" -> torch::optim::Adagrad, "Lamb" -> polytrain::Lamb
///   "CPUAdam" -> DeepSpeed's CPU Adam (cpu_adam.h: vectorised, threaded; fp32 CPU parameters)
///   "Adam8bit", "AdamW8bit", "LAMB8bit" -> 8-bit states (optimizers_8bit.h; fp32 CPU parameters)
/// bias_correction=false is honoured by Lamb (its `debias`) and is an InputError for Adam/AdamW,
/// whose libtorch implementations always correct (as torch.optim's do). Other bad values
/// (unknown type, negative lr, beta outside [0, 1), amsgrad outside Adam) are InputError
/// naming the optimizer.params key.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

/// The registry's factories (optimizer_registry.h) of the libtorch-backed optimizers.
std::unique_ptr<Optimizer> make_adam_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);
std::unique_ptr<Optimizer> make_lamb_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);
std::unique_ptr<Optimizer> make_sgd_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);
std::unique_ptr<Optimizer> make_adagrad_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

/// make_optimizer over split_by_decay(cfg, named_params), as a bare libtorch optimizer
/// (group 0 decayed, group 1 not; an empty group left out).
std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(const OptimizerConfig& cfg,
                                                              const NamedParams& named_params);

/// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::Optimizer& opt, double lr);

/// InputError unless a beta1 the schedule asks for is in [0, 1) (OneCycle's decay_mom_rate can
/// push it out).
void check_scheduled_beta1(double beta1);

/// Sets beta1 of every group of an Adam, AdamW or Lamb optimizer, keeping beta2. InputError
/// when the optimizer has no beta1 (a schedule that cycles momentum on SGD or Adagrad would
/// otherwise be silently ignored) or when beta1 is outside [0, 1) (OneCycle's decay_mom_rate
/// can push it there).
void set_beta1(torch::optim::Optimizer& opt, double beta1);

}  // namespace polytrain
