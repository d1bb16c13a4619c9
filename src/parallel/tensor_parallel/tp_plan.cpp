// TpSharding: the plan's regexes matched against module and parameter names, weights narrowed
// in place with set_data (every handle of the parameter -- a tied LM head, BERT's decoder --
// sees the part), and the slice / assemble arithmetic the checkpoints share.
#include "polytrain/parallel/tensor_parallel/tp_plan.h"

#include <regex>
#include <set>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

using detail::cat;

namespace {

int64_t padded_rows(int64_t whole, int64_t size) { return (whole + size - 1) / size * size; }

const char* style_name(TpStyle s) {
  switch (s) {
    case TpStyle::kColumn: return "column";
    case TpStyle::kRow: return "row";
    case TpStyle::kVocab: return "vocab";
    case TpStyle::kHeads: return "heads";
    default: return "replicated";
  }
}

}  // namespace

at::Tensor tp_slice(const at::Tensor& whole, const TpShardSpec& s, int64_t rank, int64_t size) {
  if (s.vocab) {
    const int64_t per = padded_rows(s.whole, size) / size, begin = rank * per;
    const int64_t valid = std::max<int64_t>(0, std::min(per, s.whole - begin));
    auto shape = whole.sizes().vec();
    shape[s.dim] = per;
    auto out = at::zeros(shape, whole.options());
    if (valid > 0) out.narrow(s.dim, 0, valid).copy_(whole.narrow(s.dim, begin, valid));
    return out;
  }
  const int64_t block = s.whole / s.blocks, chunk = block / size;
  std::vector<at::Tensor> parts;
  for (int64_t b = 0; b < s.blocks; ++b) parts.push_back(whole.narrow(s.dim, b * block + rank * chunk, chunk));
  return at::cat(parts, s.dim).contiguous();
}

at::Tensor tp_assemble(const std::vector<at::Tensor>& parts, const TpShardSpec& s) {
  if (s.vocab) return at::cat(parts, s.dim).narrow(s.dim, 0, s.whole).contiguous();
  const int64_t chunk = parts.front().size(s.dim) / s.blocks;
  std::vector<at::Tensor> pieces;
  for (int64_t b = 0; b < s.blocks; ++b)
    for (const auto& p : parts) pieces.push_back(p.narrow(s.dim, b * chunk, chunk));
  return at::cat(pieces, s.dim).contiguous();
}

TpSharding::TpSharding(torch::nn::Module& model, const TpPlan& plan, std::shared_ptr<TensorParallelRegion> region,
                       const at::Generator& generator)
    : rank_(region->rank()), size_(region->size()) {
  const int64_t p = size_;
  for (const auto& [key, n] : plan.divisible)
    PT_INPUT_CHECK(n % p == 0, "env_type deepspeed+mpu: model.", key, " (", n, ") is not divisible by model_parallel_size (",
                   p, ")");
  std::vector<std::regex> patterns;
  for (const auto& e : plan.layers) patterns.emplace_back(e.pattern, std::regex::ECMAScript);
  // TP 1: nothing to split; the layers stay plain (the fused LM loss, no collectives) and only
  // the region dropouts take the tensor-parallel stream, as Megatron's tracker does at TP 1.
  const bool whole = p == 1;
  std::vector<bool> used(plan.layers.size(), false);
  torch::NoGradGuard no_grad;

  auto split = [&](const std::string& name, at::Tensor param, TpShardSpec spec, const std::string& what) {
    spec.whole = param.size(spec.dim);
    if (!spec.vocab)
      PT_INPUT_CHECK(spec.whole % (spec.blocks * p) == 0, "env_type deepspeed+mpu: ", what, " '", name, "' ",
                     cat(param.sizes()), " has ", spec.whole, " features along dim ", spec.dim,
                     spec.blocks > 1 ? cat(" (", spec.blocks, " blocks)") : std::string(),
                     ", not divisible by model_parallel_size (", p, ")");
    whole_shapes_[name] = param.sizes().vec();
    param.set_data(tp_slice(param, spec, rank_, p));
    specs_[name] = spec;
  };

  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (!std::regex_match(name, patterns[i])) continue;
      const TpPlanEntry& e = plan.layers[i];
      auto* layer = dynamic_cast<TpShardable*>(item.value().get());
      PT_CHECK(layer, "tensor-parallel plan of ", plan.model, ": module '", name, "' (", style_name(e.style),
               ") is not a polytrain tensor-parallel layer");
      used[i] = true;
      if (whole) break;
      at::Tensor w = layer->tp_weight(), b = layer->tp_bias();
      const int64_t out = layer->tp_out_dim();
      TpSlot slot;
      slot.style = e.style;
      slot.region = region;
      slot.blocks = e.blocks;
      slot.gather_output = e.gather_output;
      slot.input_is_parallel = e.input_is_parallel;
      switch (e.style) {
        case TpStyle::kColumn:
          split(name + ".weight", w, {out, e.blocks, false, 0}, "column-parallel layer");
          if (b.defined()) split(name + ".bias", b, {0, e.blocks, false, 0}, "column-parallel layer");
          break;
        case TpStyle::kRow:
          split(name + ".weight", w, {1 - out, 1, false, 0}, "row-parallel layer");
          break;
        case TpStyle::kVocab: {
          const int64_t v = w.size(0), per = padded_rows(v, p) / p;
          split(name + ".weight", w, {0, 1, true, 0}, "vocabulary");
          if (b.defined()) split(name + ".bias", b, {0, 1, true, 0}, "vocabulary");
          slot.vocab_size = v;
          slot.vocab_begin = rank_ * per;
          slot.vocab_valid = std::max<int64_t>(0, std::min(per, v - slot.vocab_begin));
          break;
        }
        case TpStyle::kHeads:
          split(name + ".weight", w, {1, 1, false, 0}, "per-head table");
          break;
        case TpStyle::kReplicated:
          break;
      }
      layer->tp = slot;
      break;
    }
  }
  // Bare parameters split like the vocabulary (BERT's decoder bias).
  for (const auto& item : model.named_parameters(true)) {
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (plan.layers[i].style != TpStyle::kVocab || !std::regex_match(item.key(), patterns[i])) continue;
      used[i] = true;
      if (!whole && !specs_.count(item.key())) split(item.key(), item.value(), {0, 1, true, 0}, "vocabulary");
    }
  }
  for (size_t i = 0; i < plan.layers.size(); ++i)
    PT_CHECK(used[i], "tensor-parallel plan of ", plan.model, ": '", plan.layers[i].pattern, "' matches nothing");
  for (const auto& pattern : plan.region_dropouts) {
    const std::regex re(pattern, std::regex::ECMAScript);
    bool any = false;
    for (const auto& item : model.named_modules("", false)) {
      if (!std::regex_match(item.key(), re)) continue;
      auto* d = item.value()->as<DropoutImpl>();
      PT_CHECK(d, "tensor-parallel plan of ", plan.model, ": '", item.key(), "' is not a polytrain::Dropout");
      d->generator = generator;
      any = true;
    }
    PT_CHECK(any, "tensor-parallel plan of ", plan.model, ": dropout '", pattern, "' matches nothing");
  }
}

at::Tensor TpSharding::slice(const std::string& param, const at::Tensor& whole, const std::string& origin) const {
  const auto& shape = whole_shapes_.at(param);
  PT_INPUT_CHECK(whole.sizes().vec() == shape, origin, ": '", param, "' is ", cat(whole.sizes()),
                 ", the model's is ", cat(at::IntArrayRef(shape)));
  return tp_slice(whole, specs_.at(param), rank_, size_);
}

at::Tensor TpSharding::gather(const std::string& param, const at::Tensor& part, Communicator& group) const {
  auto in = part.detach().contiguous();
  auto flat = at::empty({size_ * in.numel()}, in.options());
  group.all_gather(flat, in);
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < size_; ++r) parts.push_back(flat.narrow(0, r * in.numel(), in.numel()).view(in.sizes()));
  return tp_assemble(parts, specs_.at(param));
}

void TpSharding::unshard(torch::nn::Module& model, Communicator& group) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters(true))
    if (is_sharded(item.key())) item.value().set_data(gather(item.key(), item.value(), group));
  for (auto& m : model.modules(false)) {
    if (auto* layer = dynamic_cast<TpShardable*>(m.get())) layer->tp = TpSlot();
    if (auto* d = m->as<DropoutImpl>()) d->generator.reset();
  }
  specs_.clear();
  whole_shapes_.clear();
}

}  // namespace polytrain
