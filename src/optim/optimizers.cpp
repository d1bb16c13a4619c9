// make_optimizer: OptimizerConfig -> a libtorch optimizer (or Lamb) over parameter groups
// (decay / no decay, or a backend's partitions) behind polytrain's Optimizer interface, with
// state saved by parameter name; plus the LR and beta1 setters a schedule drives.
// Golden values: scripts/gen_golden_optim.py (torch.optim 1.13 and torch_optimizer's LAMB).
#include "polytrain/optim/optimizers.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <set>
#include <unordered_set>

#include <torch/torch.h>
#include <torch/version.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/lamb.h"
#include "polytrain/optim/multi_tensor_adam.h"
#include "polytrain/optim/optim_state_key.h"
#include "polytrain/optim/optimizer_registry.h"

namespace polytrain {
namespace {

using torch::optim::OptimizerParamGroup;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

/// The libtorch optimizer over `groups`, each with its own weight decay.
template <typename Opt, typename Options>
std::unique_ptr<torch::optim::Optimizer> build(const std::vector<ParamGroup>& groups, Options options) {
  std::vector<OptimizerParamGroup> out;
  for (const auto& g : groups) {
    std::vector<torch::Tensor> tensors;
    for (const auto& [name, t] : g.params) tensors.push_back(t);
    Options o = options;
    o.weight_decay(g.weight_decay);
    out.emplace_back(std::move(tensors), std::make_unique<Options>(o));
  }
  if (!groups.empty()) options.weight_decay(groups.front().weight_decay);
  return std::make_unique<Opt>(std::move(out), options);
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

std::unique_ptr<torch::optim::Optimizer> build_torch(const OptimizerConfig& cfg, const std::vector<ParamGroup>& split) {
  const std::string type = lower(optimizer_entry(cfg.type).name);  // InputError naming the known ones
  const bool adam_like = type == "adam" || type == "adamw";
  PT_INPUT_CHECK(type != "cpuadam", "optimizer.type CPUAdam is polytrain's own kernel, not a libtorch optimizer");
  check_common(cfg, adam_like || type == "lamb");
  const auto betas = std::make_tuple(cfg.beta1, cfg.beta2);

  if (adam_like) {
    PT_INPUT_CHECK(cfg.bias_correction,
                   "optimizer.params.bias_correction=false is not supported for ", cfg.type,
                   ": torch.optim's Adam/AdamW (and libtorch's) always apply bias correction");
    if (type == "adamw" || cfg.adam_w_mode) {
      auto o = torch::optim::AdamWOptions(cfg.lr).betas(betas).eps(cfg.eps).amsgrad(cfg.amsgrad);
      return build<torch::optim::AdamW>(split, o);
    }
    auto o = torch::optim::AdamOptions(cfg.lr).betas(betas).eps(cfg.eps).amsgrad(cfg.amsgrad);
    return build<torch::optim::Adam>(split, o);
  }
  if (type == "lamb") {
    PT_INPUT_CHECK(cfg.clamp_value >= 0, "optimizer.params.clamp_value must be >= 0, got ", cfg.clamp_value);
    auto o = LambOptions(cfg.lr).betas(betas).eps(cfg.eps).clamp_value(cfg.clamp_value).debias(cfg.bias_correction);
    return build<Lamb>(split, o);
  }
  if (type == "sgd") {
    PT_INPUT_CHECK(cfg.momentum >= 0, "optimizer.params.momentum must be >= 0, got ", cfg.momentum);
    PT_INPUT_CHECK(!cfg.nesterov || (cfg.momentum > 0 && cfg.dampening == 0),
                   "optimizer.params.nesterov needs momentum > 0 and dampening 0 (got momentum ", cfg.momentum,
                   ", dampening ", cfg.dampening, ")");
    auto o = torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).dampening(cfg.dampening).nesterov(cfg.nesterov);
    return build<torch::optim::SGD>(split, o);
  }
  PT_INPUT_CHECK(cfg.lr_decay >= 0, "optimizer.params.lr_decay must be >= 0, got ", cfg.lr_decay);
  PT_INPUT_CHECK(cfg.initial_accumulator_value >= 0,
                 "optimizer.params.initial_accumulator_value must be >= 0, got ", cfg.initial_accumulator_value);
  auto o = torch::optim::AdagradOptions(cfg.lr)
               .lr_decay(cfg.lr_decay)
               .initial_accumulator_value(cfg.initial_accumulator_value)
               .eps(cfg.eps);
  return build<torch::optim::Adagrad>(split, o);
}

}  // namespace

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

void check_scheduled_beta1(double beta1) {
  PT_INPUT_CHECK(beta1 >= 0 && beta1 < 1, "momentum (beta1) ", beta1,
                 " from the schedule is outside [0, 1); check scheduler.params.decay_mom_rate");
}

void set_beta1(torch::optim::Optimizer& opt, double beta1) {
  PT_INPUT_CHECK(has_betas(opt.defaults()), "the LR schedule sets momentum (beta1 = ", beta1,
                 "), but this optimizer has no beta1 (only Adam, AdamW and Lamb do); set "
                 "scheduler.params.cycle_momentum to false or use one of those optimizers");
  check_scheduled_beta1(beta1);
  set_beta1_in(opt.defaults(), beta1);
  for (auto& group : opt.param_groups()) set_beta1_in(group.options(), beta1);
}

std::vector<ParamGroup> split_by_decay(const OptimizerConfig& cfg, const NamedParams& named_params) {
  ParamGroup decay{{}, cfg.weight_decay}, exempt{{}, 0.0};
  std::unordered_set<const void*> seen;  // tied weights appear under two names
  for (const auto& [name, tensor] : named_params) {
    PT_CHECK(tensor.defined(), "parameter '", name, "' is an undefined tensor");
    if (!tensor.requires_grad()) continue;
    if (!seen.insert(tensor.unsafeGetTensorImpl()).second) continue;
    const std::string& param = name;  // a structured binding cannot be captured before C++20 (clang)
    const bool no_decay = std::any_of(cfg.no_decay.begin(), cfg.no_decay.end(), [&](const std::string& s) {
      return !s.empty() && param.find(s) != std::string::npos;
    });
    (no_decay ? exempt : decay).params.emplace_back(name, tensor);
  }
  PT_INPUT_CHECK(!decay.params.empty() || !exempt.params.empty(),
                 "optimizer: the model has no parameters that require grad");
  std::vector<ParamGroup> out;
  for (auto* g : {&decay, &exempt})
    if (!g->params.empty()) out.push_back(std::move(*g));
  return out;
}

at::Tensor Optimizer::statistic(const at::Tensor&, const std::string& name) {
  throw InputError("optimizer " + this->name() + " has no statistic '" + name + "' to average");
}

void Optimizer::set_statistic(const at::Tensor& param, const std::string& name, const at::Tensor& value) {
  at::Tensor s = statistic(param, name);
  PT_CHECK(s.defined(), this->name(), ": statistic '", name, "' set before the parameter's first update");
  PT_CHECK(s.sizes() == value.sizes(), this->name(), ": statistic '", name, "' of shape ", s.sizes(), " set to ",
           value.sizes());
  // Nothing to do when `value` is that storage (the tensor statistic() gave, or a view of it
  // over the same elements).
  if (!s.is_same(value) && !(s.data_ptr() == value.data_ptr() && s.strides() == value.strides())) {
    torch::NoGradGuard no_grad;
    s.copy_(value);
  }
}

int64_t Optimizer::state_bytes() const {
  throw InternalError("optimizer " + name() + " does not count its state bytes");
}

namespace {

// The statistics of each libtorch state type, by torch.optim's names (Adam's and AdamW's states
// have the same accessors).
template <typename AdamState>
at::Tensor statistic_of(const AdamState& s, const std::string& n) {
  return n == "exp_avg" ? s.exp_avg() : n == "exp_avg_sq" ? s.exp_avg_sq() : n == "max_exp_avg_sq" ? s.max_exp_avg_sq() : at::Tensor();
}
at::Tensor statistic_of(const LambParamState& s, const std::string& n) {
  return n == "exp_avg" ? s.exp_avg() : n == "exp_avg_sq" ? s.exp_avg_sq() : at::Tensor();
}
at::Tensor statistic_of(const torch::optim::SGDParamState& s, const std::string& n) {
  return n == "momentum_buffer" ? s.momentum_buffer() : at::Tensor();
}
at::Tensor statistic_of(const torch::optim::AdagradParamState& s, const std::string& n) {
  return n == "sum" ? s.sum() : at::Tensor();
}

// A libtorch optimizer whose per-parameter state is of type State, saved by parameter name:
// archive "names" lists them, sub-archive "s<i>" holds parameter i's state (absent: none yet).
template <typename State>
class TorchOptimizer final : public Optimizer {
 public:
  /// multi: for Adam/AdamW, the multi-tensor mode (nullopt: chosen at the first step by the
  /// parameters' device); kOff for every other optimizer.
  TorchOptimizer(const OptimizerConfig& cfg, std::unique_ptr<torch::optim::Optimizer> opt, std::vector<ParamGroup> groups,
                 std::optional<MultiTensorMode> multi = MultiTensorMode::kOff, bool decoupled = false)
      : name_(cfg.type), opt_(std::move(opt)), multi_(multi), decoupled_(decoupled) {
    for (auto& n : optimizer_entry(cfg.type).statistics(cfg)) statistic_names_.insert(n);
    for (auto& g : groups)
      for (auto& [n, t] : g.params) params_.emplace_back(n, t);
  }
  std::string name() const override { return name_; }
  void step() override {
    if (!multi_) {  // auto: one kernel (or a few) per group on a GPU, libtorch's loop on the CPU
      bool cuda = false;
      for (const auto& [n, p] : params_) cuda = cuda || p.is_cuda();
      multi_ = !cuda ? MultiTensorMode::kOff : fused_adam_available() ? MultiTensorMode::kFused : MultiTensorMode::kForeach;
    }
    if (*multi_ == MultiTensorMode::kOff)
      opt_->step();
    else
      multi_tensor_adam_step(*opt_, *multi_, decoupled_, fused_steps_);
  }
  void zero_grad() override {
    for (auto& [n, p] : params_)
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  void set_lr(double lr) override { set_learning_rate(*opt_, lr); }
  bool has_beta1() const override { return has_betas(opt_->defaults()); }
  void set_beta1(double beta1) override { polytrain::set_beta1(*opt_, beta1); }
  torch::optim::Optimizer& torch_optimizer() override { return *opt_; }

  at::Tensor statistic(const at::Tensor& param, const std::string& name) override {
    using Key = typename std::decay_t<decltype(opt_->state())>::key_type;
    if (!statistic_names_.count(name)) Optimizer::statistic(param, name);  // throws
    auto it = opt_->state().find(optimizer_state_key<Key>(param));
    if (it == opt_->state().end()) return at::Tensor();
    return statistic_of(static_cast<const State&>(*it->second), name);
  }

  int64_t state_bytes() const override {
    using Key = typename std::decay_t<decltype(opt_->state())>::key_type;
    int64_t bytes = 0;
    for (const auto& [n, p] : params_) {
      auto it = opt_->state().find(optimizer_state_key<Key>(p));
      if (it == opt_->state().end()) continue;
      for (const auto& stat : statistic_names_) {
        const at::Tensor t = statistic_of(static_cast<const State&>(*it->second), stat);
        if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
      }
    }
    return bytes;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    using Key = typename std::decay_t<decltype(opt_->state())>::key_type;
    std::vector<std::string> names;
    for (size_t i = 0; i < params_.size(); ++i) {
      names.push_back(params_[i].first);
      auto it = opt_->state().find(optimizer_state_key<Key>(params_[i].second));
      if (it == opt_->state().end()) continue;
      torch::serialize::OutputArchive one;
      static_cast<const State&>(*it->second).serialize(one);
      archive.write("s" + std::to_string(i), one);
    }
    archive.write("names", c10::IValue(c10::List<std::string>(names)));
  }

  void load(torch::serialize::InputArchive& archive, const std::string& origin) override {
    using Key = typename std::decay_t<decltype(opt_->state())>::key_type;
    c10::IValue names_iv;
    archive.read("names", names_iv);
    std::map<std::string, size_t> saved;
    size_t i = 0;
    for (const auto& n : names_iv.toListRef()) saved[n.toStringRef()] = i++;
    std::vector<std::unique_ptr<State>> loaded(params_.size());
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& [name, p] = params_[k];
      auto it = saved.find(name);
      PT_INPUT_CHECK(it != saved.end(), origin, ": no optimizer state for parameter '", name,
                     "' (saved from another model?)");
      torch::serialize::InputArchive one;
      if (!archive.try_read("s" + std::to_string(it->second), one)) continue;  // no step taken yet
      check_shapes(one, p, name, origin);
      auto state = std::make_unique<State>();
      state->serialize(one);
      loaded[k] = std::move(state);
    }
    PT_INPUT_CHECK(saved.size() == params_.size(), origin, ": optimizer state for ", saved.size(),
                   " parameters, this optimizer has ", params_.size());
    opt_->state().clear();
    fused_steps_.by_param.clear();  // the fused kernels' step tensors are made again from the loaded steps
    for (size_t k = 0; k < params_.size(); ++k)
      if (loaded[k]) opt_->state()[optimizer_state_key<Key>(params_[k].second)] = std::move(loaded[k]);
  }

 private:
  // Every statistic of a parameter's state has the parameter's shape (moments, accumulators).
  // Other tensors (an 8-bit optimizer's codes, in a checkpoint another optimizer saved) are
  // not read.
  void check_shapes(torch::serialize::InputArchive& one, const at::Tensor& p, const std::string& name,
                    const std::string& origin) const {
    for (const auto& key : one.keys()) {
      c10::IValue v;
      if (!statistic_names_.count(key) || !one.try_read(key, v) || !v.isTensor()) continue;
      const auto t = v.toTensor();
      PT_INPUT_CHECK(t.dim() == 0 || t.sizes() == p.sizes(), origin, ": optimizer state '", key, "' of '", name,
                     "' has shape ", t.sizes(), ", the parameter ", p.sizes());
    }
  }

  std::string name_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::optional<MultiTensorMode> multi_;
  bool decoupled_;
  FusedAdamSteps fused_steps_;
  NamedParams params_;
  std::set<std::string> statistic_names_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  return optimizer_entry(cfg.type).make(cfg, std::move(groups));
}

std::unique_ptr<Optimizer> make_adam_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  auto opt = build_torch(cfg, groups);
  PT_INPUT_CHECK(!(cfg.fused.value_or(false) && cfg.foreach.value_or(false)),
                 "optimizer.params: fused and foreach cannot both be true (as in torch.optim)");
  PT_INPUT_CHECK(!cfg.fused.value_or(false) || fused_adam_available(),
                 "optimizer.params.fused needs LibTorch >= 2.0 (this build has ", TORCH_VERSION_MAJOR, ".",
                 TORCH_VERSION_MINOR, "); set foreach instead");
  PT_INPUT_CHECK(!cfg.amsgrad || !(cfg.fused.value_or(false) || cfg.foreach.value_or(false)),
                 "optimizer.params.amsgrad runs in libtorch's per-parameter loop only; drop fused/foreach");
  std::optional<MultiTensorMode> multi;  // unset: by device at the first step
  if (cfg.fused.value_or(false)) multi = MultiTensorMode::kFused;
  else if (cfg.foreach.value_or(false)) multi = MultiTensorMode::kForeach;
  else if (cfg.fused || cfg.foreach || cfg.amsgrad) multi = MultiTensorMode::kOff;  // asked off, or amsgrad
  if (lower(cfg.type) == "adam" && !cfg.adam_w_mode)
    return std::make_unique<TorchOptimizer<torch::optim::AdamParamState>>(cfg, std::move(opt), std::move(groups), multi, false);
  return std::make_unique<TorchOptimizer<torch::optim::AdamWParamState>>(cfg, std::move(opt), std::move(groups), multi, true);
}

std::unique_ptr<Optimizer> make_lamb_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  auto opt = build_torch(cfg, groups);
  return std::make_unique<TorchOptimizer<LambParamState>>(cfg, std::move(opt), std::move(groups));
}

std::unique_ptr<Optimizer> make_sgd_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  auto opt = build_torch(cfg, groups);
  return std::make_unique<TorchOptimizer<torch::optim::SGDParamState>>(cfg, std::move(opt), std::move(groups));
}

std::unique_ptr<Optimizer> make_adagrad_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  auto opt = build_torch(cfg, groups);
  return std::make_unique<TorchOptimizer<torch::optim::AdagradParamState>>(cfg, std::move(opt), std::move(groups));
}

std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(const OptimizerConfig& cfg, const NamedParams& named_params) {
  return build_torch(cfg, split_by_decay(cfg, named_params));
}

}  // namespace polytrain
