// polytrain's own CUDA kernels (compiled only where the libtorch found has CUDA and a CUDA
// compiler is present; the CPU build never sees this file). Raw pointers and a stream in, no
// ATen headers: ops/cuda_ops.cpp checks shapes and dtypes, picks the stream and launches.
//
// 1. xent_grad: the cross-entropy chain of the chunked LM loss in one kernel. For each row r
//    of logits [rows, cols] it computes M = max, S = sum exp(x - M) (one read, online), the row
//    loss w[r] * (M + log S - x[y[r]]) and, in place, w[r] * (softmax(x) - onehot(y[r])), the
//    logits' gradient (one more read and one write). -inf columns (the padded vocabulary)
//    get probability 0. ATen's path makes six passes over the block in fp32 (upcast,
//    log_softmax, exp, scatter, downcast).
// 2. add_layer_norm: h = x + y (the residual stream), out = LayerNorm(h) in the GEMM's dtype,
//    with the mean and 1/std the backward needs (ATen's layer-norm backward takes them).
// 3. rms_norm and its input gradient: T5's LayerNorm (no mean, no bias) in one pass each way,
//    in place of the five kernels forward and eight backward of its ATen formula.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda_kernels.h"

namespace polytrain::cuda_kernels {
namespace {

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Online max / sum-of-exponentials; -inf entries contribute nothing, NaN propagates.
struct MaxSum {
  float m = -INFINITY, s = 0.f;
  __device__ __forceinline__ void add(float v) {
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else if (v != -INFINITY) {
      s += expf(v - m);
    }
  }
  __device__ __forceinline__ void merge(float om, float os) {
    if (om == -INFINITY && os == 0.f) return;
    if (m == -INFINITY && s == 0.f) {
      m = om, s = os;
      return;
    }
    const float nm = fmaxf(m, om);
    s = s * expf(m - nm) + os * expf(om - nm);
    m = nm;
  }
};

constexpr int kWarp = 32;

// Block-wide merge of every thread's MaxSum; all threads get the result.
template <int kThreads>
__device__ __forceinline__ MaxSum block_max_sum(MaxSum a) {
  for (int o = kWarp / 2; o > 0; o /= 2) a.merge(__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o));
  __shared__ float sm[kThreads / kWarp], ss[kThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) sm[warp] = a.m, ss[warp] = a.s;
  __syncthreads();
  MaxSum r;
  for (int w = 0; w < kThreads / kWarp; ++w) r.merge(sm[w], ss[w]);
  return r;
}

// 16-byte vectors of T when the row allows it (cols and the row stride multiples of the vector,
// the base pointer aligned): bf16/half 8 per vector, float 4.
template <typename T>
struct Vec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

template <typename T, int kThreads>
__global__ void xent_grad_kernel(T* __restrict__ logits, int64_t cols, int64_t ld, const int64_t* __restrict__ labels,
                                 const float* __restrict__ weight, float* __restrict__ row_loss, bool vec) {
  T* x = logits + static_cast<int64_t>(blockIdx.x) * ld;
  const int64_t y = labels[blockIdx.x];
  const float w = weight[blockIdx.x];
  float xy = 0.f;
  if (threadIdx.x == 0) xy = (y >= 0 && y < cols) ? to_f(x[y]) : NAN;  // read before anything is written
  MaxSum acc;
  using V = Vec<T>;
  constexpr int n = V::n;
  if (vec) {
    const V* xv = reinterpret_cast<const V*>(x);
    for (int64_t j = threadIdx.x; j < cols / n; j += kThreads) {
      const V a = xv[j];
#pragma unroll
      for (int k = 0; k < n; ++k) acc.add(to_f(a.v[k]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) acc.add(to_f(x[j]));
  }
  const MaxSum t = block_max_sum<kThreads>(acc);
  const float inv = 1.f / t.s;
  if (threadIdx.x == 0) row_loss[blockIdx.x] = w * (t.m + logf(t.s) - xy);
  if (vec) {
    V* xv = reinterpret_cast<V*>(x);
    for (int64_t j = threadIdx.x; j < cols / n; j += kThreads) {
      V a = xv[j];
#pragma unroll
      for (int k = 0; k < n; ++k) {
        const int64_t c = j * n + k;
        float p = expf(to_f(a.v[k]) - t.m) * inv;
        if (c == y) p -= 1.f;
        a.v[k] = from_f<T>(p * w);
      }
      xv[j] = a;
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      float p = expf(to_f(x[j]) - t.m) * inv;
      if (j == y) p -= 1.f;
      x[j] = from_f<T>(p * w);
    }
  }
}

// One block per row; the row (h = x + y, fp32) is kept in dynamic shared memory between the
// statistics and the normalisation. Two-pass variance (mean first), as ATen's kernel is exact
// to fp32 rounding.
template <typename X, typename Y, typename O, int kThreads>
__global__ void add_layer_norm_kernel(const X* __restrict__ x, const Y* __restrict__ y, const float* __restrict__ gamma,
                                      const float* __restrict__ beta, int64_t cols, float eps, float* __restrict__ h,
                                      O* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  extern __shared__ float row[];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  __shared__ float red[kThreads / kWarp];
  __shared__ float stat;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  auto block_sum = [&](float v) {
    for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.f;
      for (int w = 0; w < kThreads / kWarp; ++w) s += red[w];
      stat = s;
    }
    __syncthreads();
    const float r = stat;
    __syncthreads();
    return r;
  };
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const float v = to_f(x[base + j]) + to_f(y[base + j]);
    row[j] = v;
    h[base + j] = v;
    sum += v;
  }
  const float mean = block_sum(sum) / static_cast<float>(cols);
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const float d = row[j] - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(block_sum(sq) / static_cast<float>(cols) + eps);
  for (int64_t j = threadIdx.x; j < cols; j += kThreads)
    out[base + j] = from_f<O>((row[j] - mean) * rstd * gamma[j] + beta[j]);
  if (threadIdx.x == 0) mean_out[blockIdx.x] = mean, rstd_out[blockIdx.x] = rstd;
}

// T5LayerNorm (RMSNorm): out = w * (x * rstd), rstd = 1/sqrt(mean(x^2) + eps), fp32 math.
template <typename X, typename O, int kThreads>
__global__ void rms_norm_kernel(const X* __restrict__ x, const float* __restrict__ w, int64_t cols, float eps,
                                O* __restrict__ out, float* __restrict__ rstd_out) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  __shared__ float red[kThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const float v = to_f(x[base + j]);
    sq += v * v;
  }
  for (int o = kWarp / 2; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  if (lane == 0) red[warp] = sq;
  __syncthreads();
  float total = 0.f;
  for (int k = 0; k < kThreads / kWarp; ++k) total += red[k];
  const float rstd = rsqrtf(total / static_cast<float>(cols) + eps);
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) out[base + j] = from_f<O>(w[j] * (to_f(x[base + j]) * rstd));
  if (threadIdx.x == 0) rstd_out[blockIdx.x] = rstd;
}

// Its input gradient: dx = rstd * w * g - x * rstd^3 * sum(w * g * x) / cols (per row).
template <typename X, typename G, int kThreads>
__global__ void rms_norm_backward_kernel(const G* __restrict__ g, const X* __restrict__ x, const float* __restrict__ w,
                                         const float* __restrict__ rstd_in, int64_t cols, X* __restrict__ dx) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  __shared__ float red[kThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const float r = rstd_in[blockIdx.x];
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) s += w[j] * to_f(g[base + j]) * to_f(x[base + j]);
  for (int o = kWarp / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) red[warp] = s;
  __syncthreads();
  float total = 0.f;
  for (int k = 0; k < kThreads / kWarp; ++k) total += red[k];
  const float c = total * r * r * r / static_cast<float>(cols);
  for (int64_t j = threadIdx.x; j < cols; j += kThreads)
    dx[base + j] = from_f<X>(r * w[j] * to_f(g[base + j]) - to_f(x[base + j]) * c);
}

template <typename X, typename O>
const char* launch_rms(const void* x, const float* w, int64_t rows, int64_t cols, float eps, void* out, float* rstd,
                       void* stream) {
  if (rows == 0) return nullptr;
  constexpr int kThreads = 128;
  rms_norm_kernel<X, O, kThreads><<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const X*>(x), w, cols, eps, static_cast<O*>(out), rstd);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <typename X, typename G>
const char* launch_rms_bwd(const void* g, const void* x, const float* w, const float* rstd, int64_t rows, int64_t cols,
                           void* dx, void* stream) {
  if (rows == 0) return nullptr;
  constexpr int kThreads = 128;
  rms_norm_backward_kernel<X, G, kThreads><<<static_cast<unsigned>(rows), kThreads, 0,
                                             static_cast<cudaStream_t>(stream)>>>(
      static_cast<const G*>(g), static_cast<const X*>(x), w, rstd, cols, static_cast<X*>(dx));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Calls f with a value of the C++ type that t names (float, __nv_bfloat16, __half): one
// dispatch for every kernel, nested for the kernels of two or three dtypes.
template <typename F>
const char* with_type(Dtype t, F&& f) {
  switch (t) {
    case Dtype::kFloat: return f(float{});
    case Dtype::kBFloat16: return f(__nv_bfloat16{});
    case Dtype::kHalf: return f(__half{});
  }
  return "unsupported dtype";
}

template <typename T>
const char* launch_xent(void* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* labels, const float* weight,
                        float* row_loss, void* stream) {
  if (rows == 0) return nullptr;
  const bool vec = cols % Vec<T>::n == 0 && ld % Vec<T>::n == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  auto s = static_cast<cudaStream_t>(stream);
  T* p = static_cast<T*>(logits);
  if (cols >= 8192)
    xent_grad_kernel<T, 512><<<static_cast<unsigned>(rows), 512, 0, s>>>(p, cols, ld, labels, weight, row_loss, vec);
  else
    xent_grad_kernel<T, 128><<<static_cast<unsigned>(rows), 128, 0, s>>>(p, cols, ld, labels, weight, row_loss, vec);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <typename X, typename Y, typename O>
const char* launch_aln(const void* x, const void* y, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                       float eps, float* h, void* out, float* mean, float* rstd, void* stream) {
  if (rows == 0) return nullptr;
  constexpr int kThreads = 256;
  add_layer_norm_kernel<X, Y, O, kThreads><<<static_cast<unsigned>(rows), kThreads, cols * sizeof(float),
                                             static_cast<cudaStream_t>(stream)>>>(
      static_cast<const X*>(x), static_cast<const Y*>(y), gamma, beta, cols, eps, h, static_cast<O*>(out), mean, rstd);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* xent_grad(Dtype t, void* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* labels,
                      const float* weight, float* row_loss, void* stream) {
  return with_type(t, [&](auto tag) {
    return launch_xent<decltype(tag)>(logits, rows, cols, ld, labels, weight, row_loss, stream);
  });
}

const char* add_layer_norm(Dtype x_t, Dtype y_t, Dtype out_t, const void* x, const void* y, const float* gamma,
                           const float* beta, int64_t rows, int64_t cols, float eps, float* h, void* out, float* mean,
                           float* rstd, void* stream) {
  return with_type(x_t, [&](auto xt) {
    return with_type(y_t, [&](auto yt) {
      return with_type(out_t, [&](auto ot) {
        return launch_aln<decltype(xt), decltype(yt), decltype(ot)>(x, y, gamma, beta, rows, cols, eps, h, out, mean,
                                                                    rstd, stream);
      });
    });
  });
}

const char* rms_norm(Dtype x_t, Dtype out_t, const void* x, const float* w, int64_t rows, int64_t cols, float eps,
                     void* out, float* rstd, void* stream) {
  return with_type(x_t, [&](auto xt) {
    return with_type(out_t, [&](auto ot) {
      return launch_rms<decltype(xt), decltype(ot)>(x, w, rows, cols, eps, out, rstd, stream);
    });
  });
}

const char* rms_norm_backward(Dtype x_t, Dtype g_t, const void* g, const void* x, const float* w, const float* rstd,
                              int64_t rows, int64_t cols, void* dx, void* stream) {
  return with_type(x_t, [&](auto xt) {
    return with_type(g_t, [&](auto gt) {
      return launch_rms_bwd<decltype(xt), decltype(gt)>(g, x, w, rstd, rows, cols, dx, stream);
    });
  });
}

}  // namespace polytrain::cuda_kernels
