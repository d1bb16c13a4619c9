// LAMB's update and its (de)serialization, laid out like libtorch's adam.cpp so that
// torch::serialize archives hold it the same way. Golden values: scripts/gen_golden_optim.py.
#include "polytrain/optim/lamb.h"

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include "polytrain/optim/optim_state_key.h"

namespace polytrain {

LambOptions::LambOptions(double lr) : lr_(lr) {}

bool operator==(const LambOptions& lhs, const LambOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.clamp_value() == rhs.clamp_value() &&
         lhs.debias() == rhs.debias() && lhs.adam() == rhs.adam();
}

void LambOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(clamp_value);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(debias);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adam);
}

void LambOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, clamp_value);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, debias);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adam);
}

double LambOptions::get_lr() const { return lr(); }
void LambOptions::set_lr(const double lr) { this->lr(lr); }

bool operator==(const LambParamState& lhs, const LambParamState& rhs) {
  return lhs.step() == rhs.step() && torch::equal(lhs.exp_avg(), rhs.exp_avg()) &&
         torch::equal(lhs.exp_avg_sq(), rhs.exp_avg_sq());
}

void LambParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void LambParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
}

Lamb::Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults)
    : Optimizer(std::move(param_groups), std::make_unique<LambOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
  TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
  const auto [beta1, beta2] = defaults.betas();
  TORCH_CHECK(0 <= beta1 && beta1 < 1.0, "Invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK(0 <= beta2 && beta2 < 1.0, "Invalid beta parameter at index 1: ", beta2);
  TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
  TORCH_CHECK(defaults.clamp_value() >= 0, "Invalid clamp value: ", defaults.clamp_value());
}

void lamb_update(const torch::Tensor& p, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                 const torch::Tensor& exp_avg_sq, int64_t step, const LambOptions& options) {
  torch::NoGradGuard no_grad;
  const auto [beta1, beta2] = options.betas();
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);

  double step_size = options.lr();
  if (options.debias()) {
    const double t = static_cast<double>(step);
    step_size *= std::sqrt(1 - std::pow(beta2, t)) / (1 - std::pow(beta1, t));
  }
  auto adam_step = exp_avg / exp_avg_sq.sqrt().add(options.eps());
  if (options.weight_decay() != 0) adam_step.add_(p, options.weight_decay());
  if (options.adam()) {
    p.add_(adam_step, -step_size);
    return;
  }
  // Trust ratio as a 0-d tensor: 1 where either norm is 0, without a host round trip.
  const auto weight_norm = p.norm().clamp(0, options.clamp_value());
  const auto adam_norm = adam_step.norm();
  const auto trust = torch::where(weight_norm.eq(0).logical_or(adam_norm.eq(0)),
                                  torch::ones_like(weight_norm), weight_norm / adam_norm);
  p.addcmul_(adam_step, trust * -step_size);
}

torch::Tensor Lamb::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const LambOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto& grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "Lamb does not support sparse gradients");
      const auto key = optimizer_state_key<std::decay_t<decltype(state_)>::key_type>(p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<LambParamState>();
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(fresh)).first;
      }
      auto& state = static_cast<LambParamState&>(*it->second);
      state.step(state.step() + 1);
      lamb_update(p, grad, state.exp_avg(), state.exp_avg_sq(), state.step(), options);
    }
  }
  return loss;
}

void Lamb::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }

void Lamb::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

}  // namespace polytrain
