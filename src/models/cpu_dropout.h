// Dropout on the CPU without ATen's bernoulli_, whose CPU kernel (without MKL, as in Debian's
// libtorch) draws one mt19937 number per element on one thread: 18% of a BERT-base bf16
// training step went there. Here the mask is a counter-based stream, computed on all threads,
// and not stored: the backward regenerates it from the seed.
#pragma once

#include <cstdint>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "polytrain/common/splitmix.h"

namespace polytrain {

/// The keep mask's bits: element e = 16 b + k of a dropout call with seed s (blocks of 16) is
/// kept when the low (k < 8) or high (k >= 8) 32 bits of SplitMix64's output for counter
/// s + (8 b + k % 8) * golden_gamma fall below floor((1 - p) * 2^32); this returns that output
/// for word 8 b + k % 8. Exposed for the tests.
uint64_t dropout_mask_word(uint64_t seed, uint64_t word_index);

/// The seed of one dropout call: one 64-bit draw from `generator` (the default CPU generator
/// when null). A kernel that applies the same dropout inside a fused operation (the CPU
/// attention) draws its seed here, and keeps element e when mask word e's half is below
/// dropout_keep_threshold(p), so its mask is cpu_dropout's for that seed.
uint64_t dropout_seed(at::Generator* generator);

/// floor((1 - p) * 2^32): a 32-bit half below it keeps its element.
uint32_t dropout_keep_threshold(double p);  // p in (0, 1]

/// m[0, 16) = the multipliers (scale or 0) of the mask's block `block` for `seed`: element
/// 16 b + k keeps when the low (k < 8) or high half of word 8 b + k % 8 is below `threshold`.
/// Inline, for the kernels that apply the mask (cpu_dropout, the CPU attention) to vectorize.
template <typename Acc>
__attribute__((always_inline)) inline void dropout_block_multipliers(uint64_t seed, uint32_t threshold, Acc scale,
                                                                    int64_t block, Acc* m) {
  for (int k = 0; k < 8; ++k) {
    const uint64_t w = splitmix_finalise(seed + static_cast<uint64_t>(8 * block + k) * kGoldenGamma);
    m[k] = static_cast<uint32_t>(w) < threshold ? scale : Acc(0);
    m[8 + k] = static_cast<uint32_t>(w >> 32) < threshold ? scale : Acc(0);
  }
}

/// x with each element zeroed with probability p and the rest scaled by 1 / (1 - p), in x's
/// dtype (the product in float for bf16/fp16, as ATen's opmath does), on the CPU kernels'
/// thread pool (worker_pool.h) with AVX-512 / AVX2 variants chosen at run time; the mask does
/// not depend on either. The seed is one 64-bit
/// draw from `generator` (the default CPU generator when null), so torch::manual_seed, a
/// tensor-parallel region's own generator and the checkpointed-block replay of generator
/// states all fix the mask. Differentiable in x; the backward needs only the seed. p in [0, 1];
/// x on the CPU.
at::Tensor cpu_dropout(const at::Tensor& x, double p, at::Generator* generator = nullptr);

}  // namespace polytrain
