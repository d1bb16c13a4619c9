// What the CPU optimizer benchmarks (bench_cpu_adam.cpp, bench_optim_8bit.cpp) measure their
// kernels against: this machine's memory bandwidth as a STREAM triad a = b + s*c over arrays
// far larger than the caches, all threads, with ordinary and with streaming (non-temporal)
// stores; plus the median-of-repetitions timer and the even split over threads they share.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace polytrain::bench {

/// CPUs this process may run on.
inline int cpus_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

/// Median seconds of fn() over `reps` runs after two warm-up runs.
template <typename F>
double median_seconds(int reps, F&& fn) {
  fn();
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Runs body(begin, end) over [0, n) split evenly over `threads` threads (the caller one of them).
template <typename F>
void split(int threads, int64_t n, F&& body) {
  std::vector<std::thread> pool;
  const int64_t chunk = ((n + threads - 1) / threads + 15) / 16 * 16;  // whole cache lines
  for (int t = 1; t < threads; ++t) {
    const int64_t b = std::min(n, t * chunk), e = std::min(n, b + chunk);
    pool.emplace_back([&body, b, e] { body(b, e); });
  }
  body(0, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

// The plain loop gets a clone per vector width (GCC / clang pick one at load time), so it is
// not held back by the x86-64 baseline the benchmarks are built for.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PT_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PT_BENCH_CLONES
#endif

PT_BENCH_CLONES inline void triad_plain(float* a, const float* b, const float* c, float s, int64_t begin,
                                        int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

inline void triad_stream(float* a, const float* b, const float* c, float s, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  // SSE (x86-64 baseline) is plenty for a memory-bound loop; begin is a multiple of 16 floats
  // and the arrays 64-byte aligned, so the stores are aligned.
  const __m128 vs = _mm_set1_ps(s);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4)
    _mm_stream_ps(a + i, _mm_add_ps(_mm_load_ps(b + i), _mm_mul_ps(vs, _mm_load_ps(c + i))));
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
  _mm_sfence();
#else
  triad_plain(a, b, c, s, begin, end);
#endif
}

struct Triad {
  double plain_bytes_per_s, stream_bytes_per_s;
  double best() const { return std::max(plain_bytes_per_s, stream_bytes_per_s); }
};

/// Arrays of 64M floats (256 MiB each): far beyond any cache. Touched first by the threads that
/// use them. STREAM's count: 12 bytes an element (the line an ordinary store reads first is not
/// counted; streaming stores do not read it).
inline Triad measure_triad(int threads, int reps) {
  constexpr int64_t n = int64_t{1} << 26;
  auto alloc = [] { return static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))); };
  float *a = alloc(), *b = alloc(), *c = alloc();
  split(threads, n, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f;
  });
  const double plain = median_seconds(reps, [&] {
    split(threads, n, [&](int64_t lo, int64_t hi) { triad_plain(a, b, c, 3.0f, lo, hi); });
  });
  const double stream = median_seconds(reps, [&] {
    split(threads, n, [&](int64_t lo, int64_t hi) { triad_stream(a, b, c, 3.0f, lo, hi); });
  });
  if (a[12345] != 7.0f) std::fprintf(stderr, "triad: wrong result %f\n", a[12345]);
  std::free(a);
  std::free(b);
  std::free(c);
  const double bytes = 12.0 * static_cast<double>(n);
  return {bytes / plain, bytes / stream};
}

}  // namespace polytrain::bench
