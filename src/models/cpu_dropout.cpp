#include "polytrain/models/cpu_dropout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include "polytrain/common/error.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain {

namespace {

constexpr int64_t kBlock = 16;                       // elements a block: 8 words, low halves then high halves
constexpr int64_t kGrainBlocks = 4096;               // at least 64K elements a thread

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept NaN (c10::BFloat16's rule)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Job {
  const void* in;
  void* out;
  int64_t n;
  uint64_t seed;
  uint32_t threshold;
  double scale;
};

// Blocks [b0, b1) of 16 elements, in and out pointing at block b0's first element: element
// 16b + k takes the low (k < 8) or high (k >= 8) half of word 8b + k % 8. Written for the
// compiler to vectorize 8 words at a time (64-bit lanes).
template <typename T>
__attribute__((always_inline)) inline void blocks(const Job& j, const T* in, T* out, int64_t b0, int64_t b1) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Acc s = static_cast<Acc>(j.scale);
  for (int64_t b = b0; b < b1; ++b, in += kBlock, out += kBlock) {
    Acc m[kBlock];  // the block's multipliers: s or 0
    dropout_block_multipliers<Acc>(j.seed, j.threshold, s, b, m);
    for (int k = 0; k < kBlock; ++k) {
      if constexpr (std::is_same_v<T, uint16_t>) {
        out[k] = float_to_bf16(bf16_to_float(in[k]) * m[k]);
      } else {
        out[k] = static_cast<T>(in[k] * m[k]);
      }
    }
  }
}

#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void blocks_avx512(const Job& j, const T* in, T* out,
                                                                                  int64_t b0, int64_t b1) {
  blocks<T>(j, in, out, b0, b1);
}
template <typename T>
__attribute__((target("avx2,fma"))) void blocks_avx2(const Job& j, const T* in, T* out, int64_t b0, int64_t b1) {
  blocks<T>(j, in, out, b0, b1);
}
int vector_level() {  // 2: AVX-512 with DQ (64-bit multiplies), 1: AVX2, 0: neither
  static const int level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                               ? 2
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                               : 0;
  return level;
}
#endif

template <typename T>
void run_blocks(const void* ctx, int64_t b0, int64_t b1) {
  const Job& j = *static_cast<const Job*>(ctx);
  const T* in = static_cast<const T*>(j.in);
  T* out = static_cast<T*>(j.out);
  const int64_t whole = j.n / kBlock;
  const int64_t end = std::min(b1, whole);
  if (b0 < end) {
#if defined(__x86_64__)
    const int level = vector_level();
    if (level == 2) blocks_avx512<T>(j, in + b0 * kBlock, out + b0 * kBlock, b0, end);
    else if (level == 1) blocks_avx2<T>(j, in + b0 * kBlock, out + b0 * kBlock, b0, end);
    else blocks<T>(j, in + b0 * kBlock, out + b0 * kBlock, b0, end);
#else
    blocks<T>(j, in + b0 * kBlock, out + b0 * kBlock, b0, end);
#endif
  }
  if (b1 > whole) {  // the partial last block, through the same code on a zero-padded copy
    const int64_t r = j.n - whole * kBlock;
    T pad_in[kBlock] = {}, pad_out[kBlock] = {};
    std::memcpy(pad_in, in + whole * kBlock, r * sizeof(T));
    blocks<T>(j, pad_in, pad_out, whole, whole + 1);
    std::memcpy(out + whole * kBlock, pad_out, r * sizeof(T));
  }
}

at::Tensor masked(const at::Tensor& x, uint64_t seed, double p) {
  const auto in = x.contiguous();
  auto out = at::empty_like(in, at::MemoryFormat::Contiguous);
  Job job{in.data_ptr(), out.data_ptr(), in.numel(), seed, dropout_keep_threshold(p), 1.0 / (1.0 - p)};
  const int64_t units = (job.n + kBlock - 1) / kBlock;
  const int parts = cpu_pool::parts_for(units, kGrainBlocks);
  switch (in.scalar_type()) {
    case at::kFloat: cpu_pool::run(run_blocks<float>, &job, units, parts); break;
    case at::kBFloat16: cpu_pool::run(run_blocks<uint16_t>, &job, units, parts); break;
    case at::kDouble: cpu_pool::run(run_blocks<double>, &job, units, parts); break;
    default:  // fp16 on the CPU: rare; through float
      return masked(in.to(at::kFloat), seed, p).to(in.scalar_type());
  }
  return out;
}

struct CpuDropoutFn : torch::autograd::Function<CpuDropoutFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double p, int64_t seed) {
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    return masked(x, static_cast<uint64_t>(seed), p);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double p = ctx->saved_data["p"].toDouble();
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    return {masked(grads[0], seed, p), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

uint64_t dropout_mask_word(uint64_t seed, uint64_t word_index) { return splitmix_finalise(seed + word_index * kGoldenGamma); }

at::Tensor cpu_dropout(const at::Tensor& x, double p, at::Generator* generator) {
  PT_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got ", p);
  PT_CHECK(x.device().is_cpu(), "cpu_dropout: the tensor is on ", x.device());
  if (p == 0.0) return x;
  if (p == 1.0) return x * at::zeros_like(x);
  return CpuDropoutFn::apply(x, p, static_cast<int64_t>(dropout_seed(generator)));
}

uint64_t dropout_seed(at::Generator* generator) {
  at::Generator gen = generator ? *generator : at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

uint32_t dropout_keep_threshold(double p) { return static_cast<uint32_t>(std::floor((1.0 - p) * 4294967296.0)); }

}  // namespace polytrain
