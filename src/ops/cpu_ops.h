// Fused CPU operations on polytrain's own vector kernels (ops/cpu_ops.cpp), for the chains
// where ATen's CPU kernels in Debian's libtorch are slowest in a transformer step:
// - GELU's tanh form (GPT-2's gelu_new), forward and backward: ATen's runs 4x (fp32) to 10x
//   (bf16) slower than its erf form (GPT-2 124M, bf16, batch 4 x 256: 265 ms of a 1865 ms step);
// - the LM loss's cross-entropy chain (log-softmax, gather, exp, scatter, dtype casts: ~400 ms
//   of the same step over the [tokens, 50257] logits);
// - GPT-2's causal attention (cpu_attention.cpp): scores, mask, softmax, dropout and context
//   in one pass per head, only the scores a query sees, no head transposes.
// The math is fp32 whatever the storage (fp32 or bf16), on 16 lanes whatever the vector unit
// (AVX-512, or two AVX2 registers: the same operations, so the same bits), on the thread pool
// of the other CPU kernels (optim/worker_pool.h). Other dtypes and devices keep ATen's paths.
#pragma once

#include <ATen/core/Tensor.h>

namespace polytrain::cpu_ops {

/// On unless POLYTRAIN_CPU_KERNELS=0 is in the environment (read once), or set_enabled(false).
bool enabled();
void set_enabled(bool on);

/// Caps the vector code at `level` (2: AVX-512, 1: AVX2 + FMA, 0: generic; -1: no cap) and
/// returns the level now used, at most what the CPU has. For the tests.
int set_vector_level(int level);

/// The kernels take x: enabled, on the CPU, fp32 or bf16.
bool handles(const at::Tensor& x);

/// GELU's tanh approximation of x (GPT-2's gelu_new, torch's approximate="tanh"), in x's
/// dtype, computed in fp32. Differentiable in x (once). x: handles(x). The erf form stays
/// ATen's: its vectorised kernel is as fast as this one.
at::Tensor gelu_tanh(const at::Tensor& x);

/// In place on logits [rows, cols] (CPU, fp32 or bf16, rows contiguous): with `grad`, each
/// row becomes row_weight[r] * (softmax(row) - onehot(labels[r])), the gradient of the
/// weighted cross-entropy sum, rounded once to the logits' dtype. Returns the rows' weighted
/// losses row_weight[r] * (logsumexp - row[y]), fp32 [rows]. -inf entries (a padded
/// vocabulary) get probability 0; NaN propagates to the row's loss. labels int64 [rows], each
/// in [0, cols); row_weight fp32 [rows]. The same contract as cuda_ops::xent_grad_.
at::Tensor xent_grad_(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_weight,
                      bool grad = true);

/// Whether causal_attention takes qkv with `heads` heads: enabled kernels, an fp32 CPU
/// [B, L, 3 x heads x D] tensor.
bool causal_attention_handles(const at::Tensor& qkv, int64_t heads);

/// GPT-2's causal self-attention from its fused projection qkv [B, L, 3 E] (q, k, v side by
/// side, each `heads` heads of D = E / heads): softmax(q k^T * scale) with query i seeing keys
/// <= i, dropout of the probabilities with probability dropout_p in [0, 1) (cpu_dropout's mask
/// for `seed`, so the same elements as cpu_dropout(probs, dropout_p) drawing that seed), times
/// v; returns ctx [B, L, E] with the heads side by side. Differentiable in qkv. The math of
/// the eager path (fp32 throughout; e^x to ~1 ulp) in row blocks that compute only the scores
/// their queries see, reading q, k, v in place (cpu_attention.cpp). Saves qkv and the
/// probabilities [B, heads, L, L], as the eager path does.
at::Tensor causal_attention(const at::Tensor& qkv, int64_t heads, double scale, double dropout_p, uint64_t seed);

/// dst += src for a contiguous fp32 dst and a bf16 (or fp32) src of its shape, without the
/// fp32 copy of src that ATen's mixed-dtype add_ makes first. Enabled kernels only.
void accumulate_(at::Tensor& dst, const at::Tensor& src);

/// The sum of the squares of a contiguous fp32 or bf16 CPU tensor's elements, each squared and
/// summed in double as ATen's to(double).pow(2).sum() (so a sum over another split of the same
/// elements differs by double rounding only: ZeRO's stages agree bit for bit), in one pass on
/// all threads instead of three passes and a double copy. Enabled kernels only.
double sum_of_squares(const at::Tensor& x);

}  // namespace polytrain::cpu_ops
