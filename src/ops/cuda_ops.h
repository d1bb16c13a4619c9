// Fused GPU operations on our own CUDA kernels (ops/cuda_kernels.cu), with the tensor-level
// checks and autograd around them. Where the build has no kernels (a CPU-only libtorch, or no
// CUDA compiler) available() is false and the models keep their unfused ATen paths; the
// kernels only ever run on CUDA tensors.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace polytrain::cuda_ops {

/// The kernels are in this build (a CUDA libtorch and nvcc at configure time).
bool built();
/// Built and switched on: POLYTRAIN_FUSED_KERNELS=1 in the environment, or set_enabled(true).
/// Off by default until they have passed test_cuda_ops on a GPU; off, the models take their
/// unfused ATen paths (the padded vocabulary of the fused LM loss does not depend on this).
bool available();
void set_enabled(bool on);

/// In place on logits [rows, cols] (CUDA, rows contiguous; fp32, bf16 or fp16): each row
/// becomes row_weight[r] * (softmax(row) - onehot(labels[r])), the gradient of the weighted
/// cross-entropy sum. Returns the rows' weighted losses row_weight[r] * (logsumexp - row[y]),
/// fp32 [rows]. -inf entries (padded vocabulary) get probability 0. labels int64 [rows], each
/// in [0, cols); row_weight fp32 [rows].
at::Tensor xent_grad_(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_weight);

/// h = x + y and LayerNorm(h) over the last dimension (gamma, beta fp32, eps), in one pass;
/// h in fp32, the normalised output in out_dtype. Differentiable in x, y, gamma and beta
/// (backward: ATen's layer-norm backward with the saved statistics, plus the residual path).
/// x and y: the same shape, contiguous, on the GPU. Returns {h, normalised}.
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma,
                                                 const at::Tensor& beta, double eps, at::ScalarType out_dtype);

/// T5's LayerNorm (RMSNorm, no mean, no bias): weight * (x / sqrt(mean(x^2) + eps)) over the
/// last dimension in fp32, the result in out_dtype. Differentiable in x and weight. On the GPU.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType out_dtype);

}  // namespace polytrain::cuda_ops
