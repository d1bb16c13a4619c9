// make_optimizer: OptimizerConfig -> a libtorch optimizer (or Lamb) over two parameter groups
// (decay / no decay), plus the LR and beta1 setters a schedule drives.
// Golden values: scripts/gen_golden_optim.py (torch.optim 1.13 and torch_optimizer's LAMB).
#include "trainer/optimizers.h"

#include <algorithm>
#include <cctype>
#include <unordered_set>

#include <torch/torch.h>

#include "common/config.h"
#include "common/error.h"
#include "trainer/lamb.h"

namespace polytrain {
namespace {

using torch::optim::OptimizerParamGroup;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

struct SplitParams {
  std::vector<torch::Tensor> decay;
  std::vector<torch::Tensor> no_decay;
};

SplitParams split_by_decay(const OptimizerConfig& cfg,
                           const std::vector<std::pair<std::string, torch::Tensor>>& named_params) {
  SplitParams out;
  std::unordered_set<const void*> seen;  // tied weights appear under two names
  for (const auto& [name, tensor] : named_params) {
    PT_CHECK(tensor.defined(), "parameter '", name, "' is an undefined tensor");
    if (!tensor.requires_grad()) continue;
    if (!seen.insert(tensor.unsafeGetTensorImpl()).second) continue;
    const bool exempt = std::any_of(cfg.no_decay.begin(), cfg.no_decay.end(), [&](const std::string& s) {
      return !s.empty() && name.find(s) != std::string::npos;
    });
    (exempt ? out.no_decay : out.decay).push_back(tensor);
  }
  PT_INPUT_CHECK(!out.decay.empty() || !out.no_decay.empty(),
                 "optimizer: the model has no parameters that require grad");
  return out;
}

/// Two groups sharing `options`, the first with weight_decay `wd`, the second with 0.
template <typename Opt, typename Options>
std::unique_ptr<torch::optim::Optimizer> build(const SplitParams& split, Options options, double wd) {
  std::vector<OptimizerParamGroup> groups;
  if (!split.decay.empty()) {
    Options o = options;
    o.weight_decay(wd);
    groups.emplace_back(split.decay, std::make_unique<Options>(o));
  }
  if (!split.no_decay.empty()) {
    Options o = options;
    o.weight_decay(0.0);
    groups.emplace_back(split.no_decay, std::make_unique<Options>(o));
  }
  options.weight_decay(wd);
  return std::make_unique<Opt>(std::move(groups), options);
}

void check_common(const OptimizerConfig& cfg, bool has_betas) {
  PT_INPUT_CHECK(cfg.lr >= 0, "optimizer.params.lr must be >= 0, got ", cfg.lr);
  PT_INPUT_CHECK(cfg.eps >= 0, "optimizer.params.eps must be >= 0, got ", cfg.eps);
  PT_INPUT_CHECK(cfg.weight_decay >= 0, "optimizer.params.weight_decay must be >= 0, got ", cfg.weight_decay);
  if (has_betas) {
    PT_INPUT_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1, "optimizer.params.betas[0] must be in [0, 1), got ",
                   cfg.beta1);
    PT_INPUT_CHECK(cfg.beta2 >= 0 && cfg.beta2 < 1, "optimizer.params.betas[1] must be in [0, 1), got ",
                   cfg.beta2);
  }
  if (!has_betas || lower(cfg.type) == "lamb")
    PT_INPUT_CHECK(!cfg.amsgrad, "optimizer.params.amsgrad applies to Adam/AdamW only, not ", cfg.type);
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const OptimizerConfig& cfg, const std::vector<std::pair<std::string, torch::Tensor>>& named_params) {
  const std::string type = lower(cfg.type);
  const bool adam_like = type == "adam" || type == "adamw";
  if (!adam_like && type != "lamb" && type != "sgd" && type != "adagrad")
    throw InputError(detail::cat("optimizer.type: unknown optimizer '", cfg.type,
                                 "' (known: Adam, AdamW, Lamb, SGD, Adagrad)"));
  check_common(cfg, adam_like || type == "lamb");
  const SplitParams split = split_by_decay(cfg, named_params);
  const auto betas = std::make_tuple(cfg.beta1, cfg.beta2);

  if (adam_like) {
    PT_INPUT_CHECK(cfg.bias_correction,
                   "optimizer.params.bias_correction=false is not supported for ", cfg.type,
                   ": torch.optim's Adam/AdamW (and libtorch's) always apply bias correction");
    if (type == "adamw" || cfg.adam_w_mode) {
      auto o = torch::optim::AdamWOptions(cfg.lr).betas(betas).eps(cfg.eps).amsgrad(cfg.amsgrad);
      return build<torch::optim::AdamW>(split, o, cfg.weight_decay);
    }
    auto o = torch::optim::AdamOptions(cfg.lr).betas(betas).eps(cfg.eps).amsgrad(cfg.amsgrad);
    return build<torch::optim::Adam>(split, o, cfg.weight_decay);
  }
  if (type == "lamb") {
    PT_INPUT_CHECK(cfg.clamp_value >= 0, "optimizer.params.clamp_value must be >= 0, got ", cfg.clamp_value);
    auto o = LambOptions(cfg.lr).betas(betas).eps(cfg.eps).clamp_value(cfg.clamp_value).debias(cfg.bias_correction);
    return build<Lamb>(split, o, cfg.weight_decay);
  }
  if (type == "sgd") {
    PT_INPUT_CHECK(cfg.momentum >= 0, "optimizer.params.momentum must be >= 0, got ", cfg.momentum);
    PT_INPUT_CHECK(!cfg.nesterov || (cfg.momentum > 0 && cfg.dampening == 0),
                   "optimizer.params.nesterov needs momentum > 0 and dampening 0 (got momentum ", cfg.momentum,
                   ", dampening ", cfg.dampening, ")");
    auto o = torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).dampening(cfg.dampening).nesterov(cfg.nesterov);
    return build<torch::optim::SGD>(split, o, cfg.weight_decay);
  }
  PT_INPUT_CHECK(cfg.lr_decay >= 0, "optimizer.params.lr_decay must be >= 0, got ", cfg.lr_decay);
  PT_INPUT_CHECK(cfg.initial_accumulator_value >= 0,
                 "optimizer.params.initial_accumulator_value must be >= 0, got ", cfg.initial_accumulator_value);
  auto o = torch::optim::AdagradOptions(cfg.lr)
               .lr_decay(cfg.lr_decay)
               .initial_accumulator_value(cfg.initial_accumulator_value)
               .eps(cfg.eps);
  return build<torch::optim::Adagrad>(split, o, cfg.weight_decay);
}

void set_learning_rate(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

namespace {
bool has_betas(const torch::optim::OptimizerOptions& o) {
  return dynamic_cast<const torch::optim::AdamWOptions*>(&o) != nullptr ||
         dynamic_cast<const torch::optim::AdamOptions*>(&o) != nullptr ||
         dynamic_cast<const LambOptions*>(&o) != nullptr;
}

void set_beta1_in(torch::optim::OptimizerOptions& options, double beta1) {
  auto apply = [beta1](auto* o) {
    if (o != nullptr) o->betas(std::make_tuple(beta1, std::get<1>(o->betas())));
  };
  apply(dynamic_cast<torch::optim::AdamWOptions*>(&options));
  apply(dynamic_cast<torch::optim::AdamOptions*>(&options));
  apply(dynamic_cast<LambOptions*>(&options));
}
}  // namespace

void set_beta1(torch::optim::Optimizer& opt, double beta1) {
  if (!has_betas(opt.defaults())) return;
  PT_INPUT_CHECK(beta1 >= 0 && beta1 < 1, "momentum (beta1) ", beta1,
                 " from the schedule is outside [0, 1); check scheduler.params.decay_mom_rate");
  set_beta1_in(opt.defaults(), beta1);
  for (auto& group : opt.param_groups()) set_beta1_in(group.options(), beta1);
}

}  // namespace polytrain
