#include "polytrain/models/attention.h"

#include <cmath>

#include <limits>

#include <torch/torch.h>
#include <torch/version.h>

#include "polytrain/common/error.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {

AttnImpl parse_attn_impl(const std::string& value, const std::string& key) {
  if (value == "auto") return AttnImpl::kAuto;
  if (value == "eager") return AttnImpl::kEager;
  if (value == "sdpa") return AttnImpl::kSdpa;
  throw InputError(key + ": unknown attention implementation '" + value + "' (known: auto, eager, sdpa)");
}

std::string attn_impl_name(AttnImpl impl) {
  return impl == AttnImpl::kAuto ? "auto" : impl == AttnImpl::kEager ? "eager" : "sdpa";
}

bool use_sdpa(AttnImpl impl, const at::Tensor& q, const DropoutImpl& dropout) {
  if (impl == AttnImpl::kEager || (impl == AttnImpl::kAuto && !q.is_cuda())) return false;
  return !(dropout.generator && dropout.is_training() && dropout.p > 0.0);
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool causal,
                double scale, double dropout_p) {
  // The most negative finite value of q's dtype: float's lowest would round to -inf in bf16
  // and fp16, and a row with every key masked would then be NaN instead of uniform (HF).
  const double lowest = q.scalar_type() == at::kHalf       ? double(std::numeric_limits<c10::Half>::lowest())
                        : q.scalar_type() == at::kBFloat16 ? double(std::numeric_limits<c10::BFloat16>::lowest())
                                                           : double(std::numeric_limits<float>::lowest());
  c10::optional<at::Tensor> m;
  if (mask.defined()) m = mask.clamp_min(lowest).to(q.scalar_type());
  // With a mask the causal part is folded into it (sdpa takes one or the other on every version).
  if (causal && m) {
    const int64_t lq = q.size(-2), lk = k.size(-2);
    auto future = torch::ones({lq, lk}, q.options().dtype(torch::kBool)).triu(lk - lq + 1);
    *m = m->masked_fill(future, lowest);
    causal = false;
  }
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, m, dropout_p, causal, scale);
#else
  // LibTorch 1.13: the private op of the same math, with the default scale 1/sqrt(D) only.
  const double def = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const auto qs = scale == def ? q : q * (scale / def);
  return std::get<0>(at::_scaled_dot_product_attention(qs, k, v, m, dropout_p, false, causal));
#endif
}

}  // namespace polytrain
