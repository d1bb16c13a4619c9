#include "polytrain/optim/multi_tensor_adam.h"

#include <cmath>
#include <map>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include "polytrain/common/error.h"
#include "polytrain/optim/optim_state_key.h"

namespace polytrain {

bool fused_adam_available() { return TORCH_VERSION_MAJOR >= 2; }

namespace {

template <typename State, typename Options>
void step_groups(torch::optim::Optimizer& opt, MultiTensorMode mode, bool decoupled, FusedAdamSteps& fused_steps) {
  using Key = typename std::decay_t<decltype(opt.state())>::key_type;
  at::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    const double lr = o.lr(), b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    const double eps = o.eps(), wd = o.weight_decay();
    PT_CHECK(!o.amsgrad(), "multi-tensor Adam has no amsgrad");
    // Parameters by step count (all equal unless some had no gradient at some step): the
    // foreach scalars are per step count.
    std::map<int64_t, std::vector<State*>> by_step;
    std::map<int64_t, std::vector<at::Tensor>> params_by_step;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = opt.state()[optimizer_state_key<Key>(p)];
      if (!slot) {
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<State&>(*slot);
      by_step[s.step() + 1].push_back(&s);
      params_by_step[s.step() + 1].push_back(p);
    }
    for (auto& [step, states] : by_step) {
      auto& params = params_by_step[step];
      std::vector<at::Tensor> grads, m, v;
      for (size_t i = 0; i < params.size(); ++i) {
        grads.push_back(params[i].grad());
        m.push_back(states[i]->exp_avg());
        v.push_back(states[i]->exp_avg_sq());
        states[i]->step(step);
      }
      if (mode == MultiTensorMode::kFused) {
#if TORCH_VERSION_MAJOR >= 2
        std::vector<at::Tensor> steps;
        for (const auto& p : params) {
          auto& t = fused_steps.by_param[p.unsafeGetTensorImpl()];
          if (!t.defined() || t.device() != p.device())
            t = torch::full({}, static_cast<double>(step - 1), p.options().dtype(torch::kFloat));
          steps.push_back(t);
        }
        // As torch.optim's _fused_adamw: the counts are advanced first; the kernel reads them
        // for the bias corrections (a count of 0 would divide by 1 - beta^0 = 0).
        at::_foreach_add_(steps, 1.0);
        if (decoupled)
          at::_fused_adamw_(params, grads, m, v, at::TensorList(), steps, lr, b1, b2, wd, eps, false, false);
        else
          at::_fused_adam_(params, grads, m, v, at::TensorList(), steps, lr, b1, b2, wd, eps, false, false);
        continue;
#else
        PT_CHECK(false, "fused Adam needs LibTorch >= 2.0");
#endif
      }
      // libtorch's Adam/AdamW::step, op for op, over the whole list.
      if (wd != 0.0) {
        if (decoupled)
          at::_foreach_mul_(params, 1.0 - lr * wd);
        else
          grads = at::_foreach_add(grads, params, wd);
      }
      const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
      const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
      at::_foreach_mul_(m, b1);
      at::_foreach_add_(m, grads, 1.0 - b1);
      at::_foreach_mul_(v, b2);
      at::_foreach_addcmul_(v, grads, grads, 1.0 - b2);
      auto denom = at::_foreach_sqrt(v);
      at::_foreach_div_(denom, std::sqrt(bc2));
      at::_foreach_add_(denom, eps);
      at::_foreach_addcdiv_(params, m, denom, -lr / bc1);
    }
  }
}

}  // namespace

void multi_tensor_adam_step(torch::optim::Optimizer& opt, MultiTensorMode mode, bool decoupled, FusedAdamSteps& steps) {
  if (decoupled)
    step_groups<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(opt, mode, decoupled, steps);
  else
    step_groups<torch::optim::AdamParamState, torch::optim::AdamOptions>(opt, mode, decoupled, steps);
}

}  // namespace polytrain
