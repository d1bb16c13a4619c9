// The model side of Apex-style AMP: which type a plan names, which modules are normalization
// layers, and the O2 / O3 cast.
#include "polytrain/parallel/amp.h"

#include <torch/nn/module.h>

#include "polytrain/common/error.h"

namespace polytrain {

c10::ScalarType amp_scalar_type(const std::string& name) {
  if (name == "float16") return c10::kHalf;
  if (name == "bfloat16") return c10::kBFloat16;
  PT_CHECK(name == "float32", "amp: unknown dtype '", name, "'");
  return c10::kFloat;
}

bool is_norm_module(const torch::nn::Module& m) { return m.name().find("Norm") != std::string::npos; }

void cast_model_for_amp(torch::nn::Module& model, c10::ScalarType half, bool keep_norm_fp32) {
  torch::NoGradGuard no_grad;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (keep_norm_fp32 && is_norm_module(*m)) continue;
    for (auto& p : m->named_parameters(/*recurse=*/false))
      if (p.value().is_floating_point() && p.value().scalar_type() != half) p.value().set_data(p.value().to(half));
    for (auto& b : m->named_buffers(/*recurse=*/false))
      if (b.value().is_floating_point() && b.value().scalar_type() != half) b.value().set_data(b.value().to(half));
  }
}

}  // namespace polytrain
