// The launch interface of ops/cuda_kernels.cu: raw pointers, a cudaStream_t as void*, no
// ATen or CUDA headers, so that the .cu file compiles without libtorch's headers and this one
// includes anywhere. Each returns nullptr, or the CUDA error of its launch. Callers: ops/cuda_ops.cpp.
#pragma once

#include <cstdint>

namespace polytrain::cuda_kernels {

enum class Dtype { kFloat, kBFloat16, kHalf };

/// logits [rows, cols] with row stride ld, in place -> weight[r] * (softmax - onehot(labels[r]));
/// row_loss[r] = weight[r] * (logsumexp(row) - row[labels[r]]). fp32 math.
const char* xent_grad(Dtype t, void* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* labels,
                      const float* weight, float* row_loss, void* stream);

/// h = x + y (fp32, [rows, cols] contiguous), out = (h - mean) * rstd * gamma + beta in out's
/// dtype, mean and rstd per row (fp32). gamma, beta fp32 [cols].
const char* add_layer_norm(Dtype x_t, Dtype y_t, Dtype out_t, const void* x, const void* y, const float* gamma,
                           const float* beta, int64_t rows, int64_t cols, float eps, float* h, void* out, float* mean,
                           float* rstd, void* stream);

/// out = w * (x * rstd), rstd[r] = 1/sqrt(mean(x[r]^2) + eps); w fp32 [cols].
const char* rms_norm(Dtype x_t, Dtype out_t, const void* x, const float* w, int64_t rows, int64_t cols, float eps,
                     void* out, float* rstd, void* stream);

/// dx = rstd * w * g - x * rstd^3 * sum(w * g * x) / cols, per row, in x's dtype.
const char* rms_norm_backward(Dtype x_t, Dtype g_t, const void* g, const void* x, const float* w, const float* rstd,
                              int64_t rows, int64_t cols, void* dx, void* stream);

}  // namespace polytrain::cuda_kernels
