// The fused CPU kernels of the 8-bit optimizers (bitsandbytes' Adam8bit / AdamW8bit /
// LAMB8bit): per block of 256 elements, dequantize both moments (blockwise_quant.h), do the
// update in fp32, requantize the moments with the block's new absmax. Per step that moves
// 16 bytes a parameter (read p, g and two codes; write p and two codes) where the fp32 CPU
// Adam moves 28, and the state is 2 bytes + 8/256 a parameter instead of 8.
//
// Same run-time dispatch as cpu_adam.h (scalar, AVX2 + FMA, AVX-512 F + DQ + BW; the same
// POLYTRAIN_CPU_ADAM_ISA override) and the same worker pool (worker_pool.h), threaded over
// blocks. Every kernel computes each element with the same operations (fused multiply-adds
// spelled out, the same 16-lane order for LAMB's norms), so the three give bit-identical
// results, whatever the thread count, for finite inputs (a NaN or inf gradient gives a non-
// finite parameter as in fp32 Adam, but which block scale it leaves may differ between kernels:
// the trainer skips such steps before the optimizer). The Optimizer adapters are
// optimizers_8bit.h's. Torch-free.
#pragma once

#include <cstdint>

#include "polytrain/optim/cpu_adam.h"

namespace polytrain::quant8 {
struct DynamicCode;
}

namespace polytrain::optim8bit {

using cpu_adam::Isa;

/// The 8-bit state of n elements, block-wise (blockwise_quant.h): one code per element into
/// signed_code() for the first moment and unsigned_code() for the second, and one absmax per
/// block of kBlockSize elements (quant8::num_blocks(n) floats) for each. All zero = zero moments.
struct StateView {
  uint8_t* exp_avg = nullptr;
  uint8_t* exp_avg_sq = nullptr;
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
};

/// One Adam / AdamW step over n elements, in place on `param` and the state, with cpu_adam's
/// formula and hyperparameters (cpu_adam.h: Hyper, 1-based `step`): per element
///   m = dequant(m), v = dequant(v)
///   g = grad (+ weight_decay * param when !adam_w_mode)
///   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
///   param -= lr * weight_decay * param                   (adam_w_mode)
///   param -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
/// with the fp32 m, v of this step; then m and v are requantized per block with their new
/// absmax. The last line is computed as (lr sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)),
/// one division instead of two (the divider is what bounds this kernel): m and v are bit for
/// bit cpu_adam's, param within float rounding of it. `isa` above cpu_adam::hardware_isa() is
/// an InternalError.
void adam_step(const cpu_adam::Hyper& h, int64_t step, float* param, const float* grad, const StateView& state,
               int64_t n, Isa isa = cpu_adam::detect_isa());

/// LAMB's hyperparameters, in double as polytrain::Lamb (lamb.h) takes them (1 - beta is then
/// computed before the cast to float; cpu_adam's Hyper, DeepSpeed's convention, casts first).
struct LambHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, weight_decay = 0.0, clamp_value = 10.0;
  /// Scale the step by sqrt(1 - beta2^t) / (1 - beta1^t) (torch_optimizer's `debias`).
  bool debias = true;
};

/// One LAMB step over one whole parameter of n elements, with polytrain::Lamb's semantics:
///   m, v as in adam_step (no L2 term);  u = m / (sqrt(v) + eps) + weight_decay * param
///   trust = min(||param||, clamp_value) / ||u||, or 1 when either norm is 0
///   param -= lr [* sqrt(1 - beta2^t) / (1 - beta1^t) if debias] * trust * u
/// In two passes over the blocks: the first computes m, v and u to get the norms (writing
/// nothing), the second computes them again, updates param and requantizes. The norms are
/// summed per block in fp32 in a fixed 16-lane order, then over blocks in double, in block
/// order. `scratch` holds 2 * quant8::num_blocks(n) floats. Returns the trust ratio used.
double lamb_step(const LambHyper& h, int64_t step, float* param, const float* grad, const StateView& state,
                 int64_t n, float* scratch, Isa isa = cpu_adam::detect_isa());

/// The code bytes of n values already divided by their block's absmax, as the requantization
/// of `isa`'s kernel finds them: quant8::nearest_index of each, whichever kernel (the AVX-512
/// one searches without a table gather where a value is not within kFastMargin of a
/// midpoint). For the tests, which check every float through it.
void nearest_codes(const quant8::DynamicCode& code, const float* x, int64_t n, uint8_t* out,
                   Isa isa = cpu_adam::detect_isa());

}  // namespace polytrain::optim8bit
