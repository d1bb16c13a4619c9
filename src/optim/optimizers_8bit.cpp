// Adam8bit / AdamW8bit / LAMB8bit behind the Optimizer interface (see optimizers_8bit.h):
// per-parameter 8-bit state, the kernels of cpu_optim_8bit.h, save / load by parameter name.
#include "polytrain/optim/optimizers_8bit.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>
#include <unordered_map>

#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/blockwise_quant.h"
#include "polytrain/optim/lamb.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {

// ---- QuantizedMoments ---------------------------------------------------------------------------

namespace {

const quant8::DynamicCode& code_of(const std::string& stat) {
  PT_CHECK(stat == "exp_avg" || stat == "exp_avg_sq", "8-bit moments have no '", stat, "'");
  return stat == "exp_avg" ? quant8::signed_code() : quant8::unsigned_code();
}

}  // namespace

QuantizedMoments QuantizedMoments::zeros(int64_t n) {
  QuantizedMoments q;
  const auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  q.exp_avg = torch::full({n}, quant8::signed_code().zero_index, u8);
  q.exp_avg_sq = torch::full({n}, quant8::unsigned_code().zero_index, u8);
  q.exp_avg_absmax = torch::zeros({quant8::num_blocks(n)}, torch::kFloat);
  q.exp_avg_sq_absmax = torch::zeros({quant8::num_blocks(n)}, torch::kFloat);
  return q;
}

optim8bit::StateView QuantizedMoments::view() {
  return {exp_avg.data_ptr<uint8_t>(), exp_avg_sq.data_ptr<uint8_t>(), exp_avg_absmax.data_ptr<float>(),
          exp_avg_sq_absmax.data_ptr<float>()};
}

int64_t QuantizedMoments::bytes() const {
  if (!defined()) return 0;
  return exp_avg.numel() + exp_avg_sq.numel() + 4 * (exp_avg_absmax.numel() + exp_avg_sq_absmax.numel());
}

at::Tensor QuantizedMoments::dequantized(const std::string& stat) const {
  const at::Tensor& codes = stat == "exp_avg" ? exp_avg : exp_avg_sq;
  const at::Tensor& absmax = stat == "exp_avg" ? exp_avg_absmax : exp_avg_sq_absmax;
  at::Tensor out = torch::empty({codes.numel()}, torch::kFloat);
  quant8::dequantize_blockwise(code_of(stat), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), codes.numel(),
                               out.data_ptr<float>());
  return out;
}

void QuantizedMoments::assign(const std::string& stat, const at::Tensor& values) {
  at::Tensor& codes = stat == "exp_avg" ? exp_avg : exp_avg_sq;
  at::Tensor& absmax = stat == "exp_avg" ? exp_avg_absmax : exp_avg_sq_absmax;
  PT_CHECK(values.numel() == codes.numel(), "8-bit '", stat, "' of ", codes.numel(), " elements set from ",
           values.numel());
  const at::Tensor x = values.detach().to(at::kCPU, at::kFloat).contiguous();
  quant8::quantize_blockwise(code_of(stat), x.data_ptr<float>(), x.numel(), codes.data_ptr<uint8_t>(),
                             absmax.data_ptr<float>());
}

// ---- the archive's keys, and the bridge to fp32 -----------------------------------------------

namespace optim8bit {
namespace {

struct Key {
  const char* codes;
  const char* absmax;
  const char* stat;
};
constexpr Key kKeys[2] = {{"exp_avg_codes", "exp_avg_absmax", "exp_avg"},
                          {"exp_avg_sq_codes", "exp_avg_sq_absmax", "exp_avg_sq"}};

/// The saved 8-bit state of one parameter of n elements in memory of its own, or undefined
/// moments when `saved` has none. InputError naming `what` for a partial or misfitting one.
QuantizedMoments read_saved(const std::map<std::string, at::Tensor>& saved, int64_t n, const std::string& what) {
  int present = 0;
  for (const auto& k : kKeys) present += static_cast<int>(saved.count(k.codes)) + static_cast<int>(saved.count(k.absmax));
  if (present == 0) return {};
  PT_INPUT_CHECK(present == 4, what, ": an incomplete 8-bit optimizer state (", present,
                 " of exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax)");
  QuantizedMoments q = QuantizedMoments::zeros(n);
  for (const auto& k : kKeys) {
    const at::Tensor& codes = saved.at(k.codes);
    const at::Tensor& absmax = saved.at(k.absmax);
    PT_INPUT_CHECK(codes.numel() == n, what, ": '", k.codes, "' has ", codes.numel(), " codes, the parameter ", n,
                   " elements");
    // Blocks of 2048 (earlier polytrain checkpoints): dequantized with those, requantized below.
    const bool legacy = absmax.numel() != quant8::num_blocks(n) &&
                        absmax.numel() == quant8::num_blocks(n, quant8::kLegacyBlockSize);
    PT_INPUT_CHECK(legacy || absmax.numel() == quant8::num_blocks(n), what, ": '", k.absmax, "' has ",
                   absmax.numel(), " block scales, ", n, " elements make ", quant8::num_blocks(n), " blocks of ",
                   quant8::kBlockSize, " (or ", quant8::num_blocks(n, quant8::kLegacyBlockSize), " of ",
                   quant8::kLegacyBlockSize, ")");
    const at::Tensor c = codes.reshape({-1}).to(at::kCPU);
    // Codes may have travelled as another dtype (the universal layout keeps them as uint8); any
    // value must be a whole number in [0, 255].
    const at::Tensor cd = c.to(at::kDouble);  // one conversion for the three checks
    PT_INPUT_CHECK(c.numel() == 0 || (cd.min().item<double>() >= 0 && cd.max().item<double>() <= 255 &&
                                      torch::equal(cd, cd.round())),
                   what, ": '", k.codes, "' holds values outside the codes 0..255");
    const at::Tensor a = absmax.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
    PT_INPUT_CHECK(a.numel() == 0 || (torch::isfinite(a).all().item<bool>() && a.min().item<float>() >= 0), what,
                   ": '", k.absmax, "' holds a negative or non-finite block scale");
    if (legacy) {
      const at::Tensor cb = c.to(at::kByte).contiguous();
      at::Tensor values = torch::empty({n}, torch::kFloat);
      quant8::dequantize_blockwise(code_of(k.stat), cb.data_ptr<uint8_t>(), a.data_ptr<float>(), n,
                                   values.data_ptr<float>(), quant8::kLegacyBlockSize);
      q.assign(k.stat, values);
      continue;
    }
    (k.stat == std::string("exp_avg") ? q.exp_avg : q.exp_avg_sq).copy_(c.to(at::kByte));
    (k.stat == std::string("exp_avg") ? q.exp_avg_absmax : q.exp_avg_sq_absmax).copy_(a);
  }
  return q;
}

}  // namespace

bool keeps_32bit_state(const OptimizerConfig& cfg, const std::string& name, int64_t numel) {
  if (numel < cfg.min_8bit_size) return true;
  for (const auto& sub : cfg.keep_32bit_state)
    if (!sub.empty() && name.find(sub) != std::string::npos) return true;
  return false;
}

bool is_quantized_state_key(const std::string& key) {
  for (const auto& k : kKeys)
    if (key == k.codes || key == k.absmax) return true;
  return false;
}

std::map<std::string, at::Tensor> dequantize_saved(const std::map<std::string, at::Tensor>& saved, int64_t n,
                                                   const std::string& what) {
  QuantizedMoments q = read_saved(saved, n, what);
  if (!q.defined()) return {};
  return {{"exp_avg", q.dequantized("exp_avg")}, {"exp_avg_sq", q.dequantized("exp_avg_sq")}};
}

}  // namespace optim8bit

// ---- the Optimizer ------------------------------------------------------------------------------

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

class Optimizer8bit final : public Optimizer {
 public:
  enum class Kind { kAdam, kLamb };

  Optimizer8bit(const OptimizerConfig& cfg, std::vector<ParamGroup> groups, Kind kind)
      : name_(cfg.type),
        kind_(kind),
        lr_(cfg.lr),
        beta1_(cfg.beta1),
        beta2_(cfg.beta2),
        eps_(cfg.eps),
        clamp_value_(cfg.clamp_value),
        adam_w_mode_(cfg.adam_w_mode || lower(cfg.type) == "adamw8bit"),
        bias_correction_(cfg.bias_correction) {
    PT_INPUT_CHECK(cfg.lr >= 0, "optimizer.params.lr must be >= 0, got ", cfg.lr);
    PT_INPUT_CHECK(cfg.eps >= 0, "optimizer.params.eps must be >= 0, got ", cfg.eps);
    PT_INPUT_CHECK(cfg.weight_decay >= 0, "optimizer.params.weight_decay must be >= 0, got ", cfg.weight_decay);
    PT_INPUT_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1, "optimizer.params.betas[0] must be in [0, 1), got ", cfg.beta1);
    PT_INPUT_CHECK(cfg.beta2 >= 0 && cfg.beta2 < 1, "optimizer.params.betas[1] must be in [0, 1), got ", cfg.beta2);
    PT_INPUT_CHECK(!cfg.amsgrad, "optimizer.params.amsgrad is not supported by ", cfg.type,
                   " (the 8-bit optimizers keep exp_avg and exp_avg_sq only)");
    if (kind == Kind::kLamb)
      PT_INPUT_CHECK(cfg.clamp_value >= 0, "optimizer.params.clamp_value must be >= 0, got ", cfg.clamp_value);
    std::unordered_map<const void*, std::string> seen;
    int64_t largest = 0;
    for (auto& g : groups) {
      PT_INPUT_CHECK(g.weight_decay >= 0, "optimizer: a parameter group has weight decay ", g.weight_decay);
      for (auto& [name, t] : g.params) {
        PT_INPUT_CHECK(t.defined(), name_, ": parameter '", name, "' is an undefined tensor");
        PT_INPUT_CHECK(t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == at::kFloat,
                       "optimizer.type ", name_, " steps fp32 CPU parameters only; '", name, "' is ", t.scalar_type(),
                       " on ", t.device(),
                       " (on a GPU, or with bf16 / fp16 weights, keep fp32 master weights in CPU memory: "
                       "zero_optimization.offload_optimizer, or hivemind.offload_optimizer)");
        PT_INPUT_CHECK(t.is_contiguous(), "optimizer.type ", name_, " needs contiguous parameters; '", name,
                       "' is not (strides ", t.strides(), ")");
        auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), name);
        PT_INPUT_CHECK(fresh, name_, ": parameter '", name, "' is the same tensor as '", it->second,
                       "' (it would be stepped twice)");
        slot_of_[t.unsafeGetTensorImpl()] = slots_.size();
        Slot s{name, t, static_cast<float>(g.weight_decay), g.weight_decay, 0, {}, optim8bit::keeps_32bit_state(cfg, name, t.numel()), {}, {}};
        if (!s.full) largest = std::max(largest, t.numel());
        slots_.push_back(std::move(s));
      }
    }
    // LAMB's per-block norms, kept for every step (2 floats a block of the largest parameter).
    if (kind_ == Kind::kLamb) scratch_.assign(static_cast<size_t>(2 * quant8::num_blocks(largest)), 0.0f);
  }

  std::string name() const override { return name_; }

  void step() override {
    const optim8bit::Isa isa = cpu_adam::detect_isa();
    for (auto& s : slots_) {
      at::Tensor g = s.param.grad();
      if (!g.defined()) continue;
      PT_INPUT_CHECK(g.layout() == at::kStrided && g.device().is_cpu() && g.scalar_type() == at::kFloat &&
                         g.sizes() == s.param.sizes(),
                     name_, ": the gradient of '", s.name, "' must be a dense fp32 CPU tensor of shape ",
                     s.param.sizes(), ", got ", g.scalar_type(), " ", g.sizes(), " on ", g.device());
      if (!g.is_contiguous()) g = g.contiguous();
      ++s.step;
      if (s.full) {
        step_32bit(s, g, isa);
        continue;
      }
      if (!s.state.defined()) s.state = QuantizedMoments::zeros(s.param.numel());
      if (kind_ == Kind::kAdam) {
        optim8bit::adam_step(adam_hyper(s), s.step, s.param.data_ptr<float>(), g.data_ptr<float>(), s.state.view(),
                             s.param.numel(), isa);
      } else {
        optim8bit::LambHyper h;
        h.lr = lr_;
        h.beta1 = beta1_;
        h.beta2 = beta2_;
        h.eps = eps_;
        h.weight_decay = s.weight_decay_double;
        h.clamp_value = clamp_value_;
        h.debias = bias_correction_;
        optim8bit::lamb_step(h, s.step, s.param.data_ptr<float>(), g.data_ptr<float>(), s.state.view(),
                             s.param.numel(), scratch_.data(), isa);
      }
      // Written through the raw pointer: tell autograd the tensor changed, as an in-place op would.
      if (!s.param.is_inference()) s.param.unsafeGetTensorImpl()->bump_version();
    }
  }

  void zero_grad() override {
    for (auto& s : slots_)
      if (s.param.grad().defined()) s.param.mutable_grad().zero_();
  }

  void set_lr(double lr) override { lr_ = lr; }
  bool has_beta1() const override { return true; }
  void set_beta1(double beta1) override {
    check_scheduled_beta1(beta1);
    beta1_ = beta1;
  }

  torch::optim::Optimizer& torch_optimizer() override {
    throw InternalError(name_ + " has no libtorch optimizer underneath");
  }

  /// A dequantized copy (8-bit state), or the 32-bit state itself.
  at::Tensor statistic(const at::Tensor& param, const std::string& name) override {
    const Slot* s = slot_for(param, name);
    if (s == nullptr || !s->has_state()) return at::Tensor();
    if (s->full) return (name == "exp_avg" ? s->m32 : s->v32).view(s->param.sizes());
    return s->state.dequantized(name).view(s->param.sizes());
  }

  void set_statistic(const at::Tensor& param, const std::string& name, const at::Tensor& value) override {
    Slot* s = slot_for(param, name);
    PT_CHECK(s != nullptr && s->has_state(), name_, ": statistic '", name, "' set before the first update");
    PT_CHECK(value.sizes() == s->param.sizes(), name_, ": statistic '", name, "' of '", s->name, "' set to shape ",
             value.sizes());
    if (s->full) return Optimizer::set_statistic(param, name, value);  // statistic() is the storage
    s->state.assign(name, value);
  }

  int64_t state_bytes() const override {
    int64_t bytes = static_cast<int64_t>(scratch_.size() * sizeof(float));
    for (const auto& s : slots_) {
      bytes += s.state.bytes();
      if (s.m32.defined()) bytes += 4 * (s.m32.numel() + s.v32.numel());
    }
    return bytes;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    std::vector<std::string> names;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      names.push_back(s.name);
      if (!s.has_state()) continue;
      torch::serialize::OutputArchive one;
      one.write("step", c10::IValue(s.step));
      if (s.full) {  // as CPUAdam / AdamW / Lamb save it
        one.write("exp_avg", s.m32.view(s.param.sizes()));
        one.write("exp_avg_sq", s.v32.view(s.param.sizes()));
        archive.write("s" + std::to_string(i), one);
        continue;
      }
      one.write("exp_avg_codes", s.state.exp_avg);
      one.write("exp_avg_absmax", s.state.exp_avg_absmax);
      one.write("exp_avg_sq_codes", s.state.exp_avg_sq);
      one.write("exp_avg_sq_absmax", s.state.exp_avg_sq_absmax);
      archive.write("s" + std::to_string(i), one);
    }
    archive.write("names", c10::IValue(c10::List<std::string>(names)));
  }

  void load(torch::serialize::InputArchive& archive, const std::string& origin) override {
    c10::IValue names_iv;
    archive.read("names", names_iv);
    std::map<std::string, size_t> saved;
    size_t i = 0;
    for (const auto& n : names_iv.toListRef()) saved[n.toStringRef()] = i++;
    struct Loaded {
      int64_t step = 0;
      QuantizedMoments state;
      at::Tensor m32, v32;
    };
    std::vector<Loaded> loaded(slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k) {
      const Slot& s = slots_[k];
      auto it = saved.find(s.name);
      PT_INPUT_CHECK(it != saved.end(), origin, ": no optimizer state for parameter '", s.name,
                     "' (saved from another model?)");
      torch::serialize::InputArchive one;
      if (!archive.try_read("s" + std::to_string(it->second), one)) continue;  // no step taken yet
      loaded[k].step = read_step(one, s.name, origin);
      read_state(one, s, origin, loaded[k].state, loaded[k].m32, loaded[k].v32);
    }
    PT_INPUT_CHECK(saved.size() == slots_.size(), origin, ": optimizer state for ", saved.size(),
                   " parameters, this optimizer has ", slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k) {
      slots_[k].step = loaded[k].step;
      slots_[k].state = loaded[k].state;
      slots_[k].m32 = loaded[k].m32;
      slots_[k].v32 = loaded[k].v32;
    }
  }

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    float weight_decay;
    double weight_decay_double;  ///< the group's, as LAMB takes it
    int64_t step;                ///< updates applied to this parameter
    QuantizedMoments state;  ///< undefined until its first update (and for a 32-bit slot)
    bool full;               ///< 32-bit state (min_8bit_size, keep_32bit_state)
    at::Tensor m32, v32;     ///< a 32-bit slot's moments, flat; undefined until its first update
    bool has_state() const { return full ? m32.defined() : state.defined(); }
  };

  /// Adam's hyperparameters for slot s, as cpu_adam and the 8-bit kernel take them.
  cpu_adam::Hyper adam_hyper(const Slot& s) const {
    cpu_adam::Hyper h;
    h.lr = static_cast<float>(lr_);
    h.beta1 = static_cast<float>(beta1_);
    h.beta2 = static_cast<float>(beta2_);
    h.eps = static_cast<float>(eps_);
    h.weight_decay = s.weight_decay;
    h.adam_w_mode = adam_w_mode_;
    h.bias_correction = bias_correction_;
    return h;
  }

  /// A 32-bit slot's step: the fp32 CPU Adam kernel with the same hyperparameters, or Lamb's.
  void step_32bit(Slot& s, const at::Tensor& g, optim8bit::Isa isa) {
    if (!s.m32.defined()) {
      s.m32 = torch::zeros({s.param.numel()}, torch::kFloat);
      s.v32 = torch::zeros({s.param.numel()}, torch::kFloat);
    }
    if (kind_ == Kind::kAdam) {
      cpu_adam::step(adam_hyper(s), s.step, s.param.data_ptr<float>(), g.data_ptr<float>(), s.m32.data_ptr<float>(),
                     s.v32.data_ptr<float>(), s.param.numel(), cpu_adam::CopyOut::kNone, nullptr, isa);
      if (!s.param.is_inference()) s.param.unsafeGetTensorImpl()->bump_version();
      return;
    }
    LambOptions o(lr_);
    o.betas(std::make_tuple(beta1_, beta2_)).eps(eps_).weight_decay(s.weight_decay_double);
    o.clamp_value(clamp_value_).debias(bias_correction_);
    lamb_update(s.param, g.view(s.param.sizes()), s.m32.view(s.param.sizes()), s.v32.view(s.param.sizes()), s.step,
                o);
  }

  Slot* slot_for(const at::Tensor& param, const std::string& name) {
    if (name != "exp_avg" && name != "exp_avg_sq") Optimizer::statistic(param, name);  // throws
    const auto it = slot_of_.find(param.unsafeGetTensorImpl());
    return it == slot_of_.end() ? nullptr : &slots_[it->second];
  }

  static int64_t read_step(torch::serialize::InputArchive& one, const std::string& name, const std::string& origin) {
    c10::IValue v;
    PT_INPUT_CHECK(one.try_read("step", v), origin, ": the optimizer state of '", name, "' has no 'step'");
    int64_t step = -1;
    if (v.isInt()) step = v.toInt();
    else if (v.isDouble()) step = static_cast<int64_t>(v.toDouble());
    else if (v.isTensor() && v.toTensor().numel() == 1) step = static_cast<int64_t>(v.toTensor().item<double>());
    PT_INPUT_CHECK(step >= 0, origin, ": the optimizer state of '", name, "' has an unreadable 'step'");
    return step;
  }

  // The 8-bit state as saved (exact), or fp32 moments quantized; for a 32-bit slot, fp32
  // moments as saved, or the saved 8-bit state dequantized.
  void read_state(torch::serialize::InputArchive& one, const Slot& s, const std::string& origin, QuantizedMoments& out,
                  at::Tensor& m32, at::Tensor& v32) const {
    const std::string what = origin + ": the optimizer state of '" + s.name + "'";
    std::map<std::string, at::Tensor> tensors;
    for (const auto& key : one.keys()) {
      c10::IValue v;
      if (one.try_read(key, v) && v.isTensor()) tensors[key] = v.toTensor();
    }
    PT_INPUT_CHECK(!tensors.count("max_exp_avg_sq"), what, " is AMSGrad's (max_exp_avg_sq), which ", name_,
                   " does not have");
    QuantizedMoments q = optim8bit::read_saved(tensors, s.param.numel(), what);
    if (q.defined()) {
      if (!s.full) {
        out = q;
        return;
      }
      m32 = q.dequantized("exp_avg");
      v32 = q.dequantized("exp_avg_sq");
      return;
    }
    q = QuantizedMoments::zeros(s.param.numel());
    for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
      auto it = tensors.find(stat);
      PT_INPUT_CHECK(it != tensors.end(), what, " has neither the 8-bit moments (exp_avg_codes, ...) nor '", stat,
                     "'");
      PT_INPUT_CHECK(it->second.numel() == s.param.numel() && it->second.is_floating_point(), what, ": '", stat,
                     "' has shape ", it->second.sizes(), ", the parameter ", s.param.sizes());
      if (s.full) {
        (stat == std::string("exp_avg") ? m32 : v32) = it->second.detach().to(at::kCPU, at::kFloat).reshape({-1}).clone();
      } else {
        q.assign(stat, it->second);
      }
    }
    if (!s.full) out = q;
  }

  std::string name_;
  Kind kind_;
  double lr_, beta1_, beta2_, eps_, clamp_value_;
  bool adam_w_mode_, bias_correction_;
  std::vector<Slot> slots_;
  std::unordered_map<const void*, size_t> slot_of_;  ///< parameter -> its slot
  std::vector<float> scratch_;                        ///< LAMB: per-block sums of squares
};

}  // namespace

std::unique_ptr<Optimizer> make_adam_8bit(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  return std::make_unique<Optimizer8bit>(cfg, std::move(groups), Optimizer8bit::Kind::kAdam);
}

std::unique_ptr<Optimizer> make_lamb_8bit(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  return std::make_unique<Optimizer8bit>(cfg, std::move(groups), Optimizer8bit::Kind::kLamb);
}

}  // namespace polytrain
