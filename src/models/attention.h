// Scaled dot-product attention for the models: the exact math (HF's eager path: scores,
// softmax in fp32 under autocast, dropout, context) or LibTorch's fused
// scaled_dot_product_attention (flash / memory-efficient kernels on a GPU), chosen by the
// model config's `attn_implementation` (HF's names): "eager", "sdpa", or "auto" (the
// default: sdpa on CUDA, eager elsewhere, so the CPU default stays the exact path).
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace polytrain {

struct DropoutImpl;

enum class AttnImpl { kAuto, kEager, kSdpa };

/// "auto" | "eager" | "sdpa" -> AttnImpl; InputError naming `key` (e.g. "model.attn_implementation").
AttnImpl parse_attn_impl(const std::string& value, const std::string& key);
std::string attn_impl_name(AttnImpl impl);

/// Whether attention over query `q` runs through sdpa: kSdpa always, kAuto on CUDA, except
/// where `dropout` draws from a tensor-parallel region's generator while training (the fused
/// kernels draw from the device's default generator, so such a model keeps the eager path).
bool use_sdpa(AttnImpl impl, const at::Tensor& q, const DropoutImpl& dropout);

/// softmax(q k^T * scale + mask) v through LibTorch's scaled_dot_product_attention.
/// q, k, v: [B, H, L, D]. mask: additive float mask broadcastable to [B, H, Lq, Lk]
/// (0 = attend; a large negative value = masked; undefined = none), cast to q's dtype.
/// causal: query i sees keys <= i (with no mask given: the flash kernel's causal path).
/// dropout_p: on the probabilities (0 in eval).
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool causal,
                double scale, double dropout_p);

}  // namespace polytrain
