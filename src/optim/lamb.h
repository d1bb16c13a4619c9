// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") with the semantics of
// torch_optimizer.Lamb, the variant hivemind's collaborative ALBERT recipe trains with.
// A libtorch Optimizer with save/load like torch::optim::Adam; building it from the config is
// optimizers.h's job.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

namespace polytrain {

struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3);  // NOLINT: implicit like torch::optim::AdamOptions
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  /// Decay rates of the first and second moment averages.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to sqrt(v) in the Adam direction (torch_optimizer's default is 1e-6).
  TORCH_ARG(double, eps) = 1e-6;
  /// Coefficient of w added to the Adam direction before the trust ratio (decoupled decay).
  TORCH_ARG(double, weight_decay) = 0.0;
  /// ||w|| is clamped to [0, clamp_value] in the trust ratio.
  TORCH_ARG(double, clamp_value) = 10.0;
  /// Scale the step by sqrt(1 - beta2^t) / (1 - beta1^t) (torch_optimizer's `debias`).
  TORCH_ARG(bool, debias) = false;
  /// Trust ratio always 1, which makes this Adam without bias correction (for comparisons).
  TORCH_ARG(bool, adam) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const LambOptions& lhs, const LambOptions& rhs);
};

struct LambParamState : public torch::optim::OptimizerCloneableParamState<LambParamState> {
  /// Updates applied to this parameter (t in the bias correction).
  TORCH_ARG(int64_t, step) = 0;
  /// First moment m.
  TORCH_ARG(torch::Tensor, exp_avg);
  /// Second moment v.
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const LambParamState& lhs, const LambParamState& rhs);
};

/// Per parameter w with gradient g, at step t:
///   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
///   u = m / (sqrt(v) + eps) + weight_decay * w            (no bias correction inside u)
///   trust = min(||w||, clamp_value) / ||u||, or 1 when either norm is 0 (or adam=true)
///   w -= lr * [sqrt(1 - b2^t) / (1 - b1^t) if debias] * trust * u
/// The trust ratio stays on the device (no host sync per parameter).
class Lamb : public torch::optim::Optimizer {
 public:
  explicit Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults = {});
  explicit Lamb(std::vector<torch::Tensor> params, LambOptions defaults = {})
      : Lamb({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<LambParamState, LambOptions>(archive, self);
  }
};

/// One step of the update above on one parameter with its moments (in place), `step` the
/// 1-based t; what Lamb::step does per parameter, and what LAMB8bit uses for a parameter whose
/// state stays 32-bit.
void lamb_update(const torch::Tensor& p, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                 const torch::Tensor& exp_avg_sq, int64_t step, const LambOptions& options);

}  // namespace polytrain
