// This machine's GEMM rates and the limits above them, measured in the run that compares
// against them: the fp32 GEMM rate on the BLAS libtorch runs (at::mm), the bf16 GEMM rate
// (at::mm on bf16 tensors: oneDNN on CPU), and the cores' arithmetic peaks from register-only
// loops (fp32 FMA with AVX-512 or AVX2; bf16 with AMX's TDPBF16PS or AVX512-BF16's VDPBF16PS),
// each on every thread at once.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <string>
#include <thread>
#include <vector>
#include <vector>

#include <ATen/ATen.h>

namespace polytrain::bench {

inline double gemm_gflops(int64_t n = 1024, int batches = 5, int reps = 8, at::ScalarType dtype = at::kFloat) {
  auto a = at::randn({n, n}).to(dtype), b = at::randn({n, n}).to(dtype), c = at::empty({n, n}, dtype);
  at::mm_out(c, a, b);  // warm-up: pages, BLAS threads
  double best = 0;
  for (int k = 0; k < batches; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) at::mm_out(c, a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n * reps / s / 1e9);
  }
  return best;
}

// The matmuls of one GPT-2 124M forward + backward at batch 4 x 256 (1024 tokens), each in the
// orientation the model and autograd hand it (C = A B with A or B transposed in memory): the
// four Conv1D layers' forward, input and weight gradients, one 8192-row block of the tied LM
// head (the fused loss's chunk), and the attention products (48 heads x 256 x 256 x 64) as bmm.
// Runs on whatever engine at::mm / at::bmm reach (src/ops/cpu_gemm). Returns GFLOP/s over the set.
inline double gpt2_matmul_gflops(int reps = 3) {
  struct Mm { int64_t m, n, k; bool ta, tb; };
  const int64_t t = 1024, v = 8192;
  const Mm mms[] = {{t, 2304, 768, 0, 0}, {t, 768, 2304, 0, 1}, {768, 2304, t, 1, 0}, {t, 768, 768, 0, 0},
                    {t, 768, 768, 0, 1},  {768, 768, t, 1, 0},  {t, 3072, 768, 0, 0}, {t, 768, 3072, 0, 1},
                    {768, 3072, t, 1, 0}, {t, 768, 3072, 0, 0}, {t, 3072, 768, 0, 1}, {3072, 768, t, 1, 0},
                    {t, v, 768, 0, 1},    {t, 768, v, 0, 0},    {v, 768, t, 1, 0}};
  std::vector<std::array<at::Tensor, 3>> ops;
  double flop = 0;
  for (const auto& m : mms) {
    auto a = m.ta ? at::randn({m.k, m.m}).t() : at::randn({m.m, m.k});
    auto b = m.tb ? at::randn({m.n, m.k}).t() : at::randn({m.k, m.n});
    ops.push_back({a, b, at::empty({m.m, m.n})});
    flop += 2.0 * m.m * m.n * m.k;
  }
  const int64_t heads = 48, l = 256, d = 64;
  auto q = at::randn({heads, l, d}), k = at::randn({heads, l, d}), s = at::empty({heads, l, l}), o = at::empty({heads, l, d});
  auto run = [&] {
    for (auto& op : ops) at::mm_out(op[2], op[0], op[1]);
    at::bmm_out(s, q, k.transpose(1, 2));  // scores
    at::bmm_out(o, s, k);                  // context
  };
  flop += 2 * 2.0 * heads * l * l * d;
  run();  // warm-up: pages, JIT kernels, threads
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::max(best, flop / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
  }
  return best;
}

namespace detail {

// FLOPs one thread's loop ran in about `seconds`; 0 where the CPU lacks the instructions.
__attribute__((target("avx512f"))) inline double fma512_loop(double seconds) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1.0f + i);
  const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-7f);
  long iters = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < 1000; ++r)
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, a);
    iters += 1000;
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return iters * 12.0 * 16 * 2;
}

__attribute__((target("avx2,fma"))) inline double fma256_loop(double seconds) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(1.0f + i);
  const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
  long iters = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < 1000; ++r)
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, a);
    iters += 1000;
  }
  float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_storeu_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return iters * 12.0 * 8 * 2;
}

// AMX: four 16x16 fp32 accumulator tiles, each TDPBF16PS a 16x32 by 32x16 bf16 product
// (16 * 16 * 32 * 2 FLOPs). Linux hands out the tile state only on request (arch_prctl).
__attribute__((target("amx-tile,amx-bf16"))) inline double amx_loop(double seconds) {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return 0;
  alignas(64) unsigned char cfg[64] = {};
  cfg[0] = 1;  // palette 1: 8 tiles of 16 rows x 64 bytes
  for (int t = 0; t < 8; ++t) {
    reinterpret_cast<uint16_t*>(cfg + 16)[t] = 64;  // bytes per row
    cfg[48 + t] = 16;                               // rows
  }
  _tile_loadconfig(cfg);
  alignas(64) static uint16_t data[16 * 32] = {};
  _tile_loadd(4, data, 64);
  _tile_loadd(5, data, 64);
  _tile_loadd(6, data, 64);
  _tile_loadd(7, data, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  long iters = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < 256; ++r) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    iters += 256;
  }
  alignas(64) static float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return iters * 4.0 * 16 * 16 * 32 * 2;
}

template <class F>
double on_threads(int threads, double seconds, F loop) {
  std::vector<double> flops(threads);
  std::vector<std::thread> t;
  for (int i = 0; i < threads; ++i) t.emplace_back([&, i] { flops[i] = loop(seconds); });
  for (auto& th : t) th.join();
  double sum = 0;
  for (double f : flops) sum += f;
  return sum / seconds / 1e9;
}

}  // namespace detail

/// The fp32 FMA peak of `threads` cores in GFLOP/s and the instruction set it used.
inline std::pair<double, std::string> fp32_peak_gflops(int threads, double seconds = 0.3) {
  if (__builtin_cpu_supports("avx512f")) return {detail::on_threads(threads, seconds, detail::fma512_loop), "AVX-512 FMA"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {detail::on_threads(threads, seconds, detail::fma256_loop), "AVX2 FMA"};
  return {0, "none"};
}

/// The bf16 matrix peak (AMX tiles) in GFLOP/s, 0 where the CPU or the kernel has no AMX.
inline double amx_bf16_peak_gflops(int threads, double seconds = 0.3) {
  if (!__builtin_cpu_supports("avx512f")) return 0;
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
  return amx ? detail::on_threads(threads, seconds, detail::amx_loop) : 0;
}

}  // namespace polytrain::bench
