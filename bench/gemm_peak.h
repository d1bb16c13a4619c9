// This machine's fp32 GEMM rate on the BLAS libtorch runs (at::mm, square 1024 matrices, the
// threads currently set), best of several timed batches: the hardware limit a step's FLOPs
// are compared against in bench/bert_step.sh and bench/gpt2_step.sh.
#pragma once

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

namespace polytrain::bench {

inline double gemm_gflops(int64_t n = 1024, int batches = 5, int reps = 8) {
  auto a = at::randn({n, n}), b = at::randn({n, n}), c = at::empty({n, n});
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

}  // namespace polytrain::bench
