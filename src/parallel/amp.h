// Apex-style AMP (the `amp` block, common/config.h AmpPlan) applied to a model: the half type,
// and the cast of O2 / O3 (trainable weights and floating buffers to half, normalization layers
// kept fp32 when the plan says so). The master weights of O2 live in ReplicatedBackend.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

#include "polytrain/common/config.h"
#include "polytrain/common/torch_fwd.h"

namespace polytrain {

/// "float16" / "bfloat16" / "float32" -> the c10 type.
c10::ScalarType amp_scalar_type(const std::string& name);

/// A normalization layer (LayerNorm, T5's RMS norm, BatchNorm, GroupNorm, ...): a module whose
/// type name has "Norm" in it. Apex keeps BatchNorm fp32; in a transformer the normalization
/// layers are these.
bool is_norm_module(const torch::nn::Module& m);

/// Casts every floating parameter and buffer of `model` to `half`, except those of
/// normalization layers when `keep_norm_fp32`. In place (the tensors keep their identity).
void cast_model_for_amp(torch::nn::Module& model, c10::ScalarType half, bool keep_norm_fp32);

}  // namespace polytrain
