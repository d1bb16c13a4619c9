// Worker of bench/cpu_adam.sh: the CPU Adam kernel (optim/cpu_adam.h) against libtorch's
// AdamW and against this machine's memory bandwidth, in parameter updates per second.
//   bench_cpu_adam [all] [params=N] [reps=R]
//     (d) a STREAM triad a = b + s*c over three arrays far larger than the caches, all threads,
//         with ordinary stores and with streaming (non-temporal) stores; the faster gives the
//         bandwidth B and the limit B / 28 updates/s (an Adam step reads p, g, m, v and writes
//         p, m, v: 28 bytes a parameter; 30 with a bf16 copy);
//     (e) the same 28 bytes a parameter without Adam's arithmetic (read four arrays, write three
//         of them back in place): what this access pattern reaches here. On machines whose
//         cores' bandwidth is bound by outstanding misses (VMs, few cores of a large part) seven
//         streams go faster than the triad's three, so (d)'s limit can be beaten; (e) is the
//         tighter reference;
//     (a) cpu_adam::step in AdamW mode over one flat fp32 range of N parameters, all threads,
//         without and with the fused bf16 copy-out;
//     (b) torch::optim::AdamW::step on one N-element parameter, as is;
//     then the ratios ours / torch and ours / limit.
//   bench_cpu_adam torch [raised] [params=N] [reps=R]
//     (b) alone, or (c) with glibc's mmap and trim thresholds raised to 1 GiB first
//     (mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD)): libtorch's AdamW allocates temporaries the
//     size of the parameter every step, which glibc serves by fresh mmap (page faults and
//     zeroing every step) unless the threshold is above their size. mallopt changes the whole
//     process, hence a process of its own.
// N defaults to 32M (2^25). Each figure is the median of `reps` timed repetitions after two
// warm-up ones. "All threads": at::set_num_threads(CPUs this process may run on), for ours and
// for libtorch alike. Output: one "key value" line per figure (the script reads them).
#include <malloc.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <torch/torch.h>

#include "polytrain/optim/cpu_adam.h"
#include "mem_bandwidth.h"

using Clock = std::chrono::steady_clock;
namespace cpu_adam = polytrain::cpu_adam;

namespace {

using polytrain::bench::cpus_available;
using polytrain::bench::measure_triad;
using polytrain::bench::median_seconds;
using polytrain::bench::split;
using polytrain::bench::Triad;

// The plain loops get a clone per vector width (GCC / clang pick one at load time), so they
// are not held back by the x86-64 baseline the rest of this file is built for.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PT_CLONES
#endif

PT_CLONES void traffic7(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i];
    const float mi = m[i] * 0.9f + gi;
    v[i] = v[i] * 0.99f + gi * gi;
    m[i] = mi;
    p[i] = p[i] - 1e-4f * mi;
  }
}

/// (e): updates/s of traffic7 over n parameters, all threads.
double measure_traffic7(int threads, int64_t n, int reps) {
  auto p = torch::randn({n}), g = torch::randn({n}) * 1e-3, m = torch::zeros({n}), v = torch::zeros({n});
  float *pp = p.data_ptr<float>(), *gp = g.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const double s = median_seconds(reps, [&] {
    split(threads, n, [&](int64_t lo, int64_t hi) { traffic7(pp, gp, mp, vp, lo, hi); });
  });
  return static_cast<double>(n) / s;
}

/// cpu_adam::step updates/s in AdamW mode (weight decay 0.01) over n parameters.
double measure_ours(int64_t n, int reps, cpu_adam::CopyOut copy) {
  auto p = torch::randn({n}), g = torch::randn({n}) * 1e-3, m = torch::zeros({n}), v = torch::zeros({n});
  auto out = torch::empty({n}, torch::kBFloat16);
  cpu_adam::Hyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.01f;
  int64_t step = 0;
  const double s = median_seconds(reps, [&] {
    cpu_adam::step(h, ++step, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                   copy, reinterpret_cast<uint16_t*>(out.data_ptr()));
  });
  return static_cast<double>(n) / s;
}

/// torch::optim::AdamW::step updates/s on one n-element parameter (weight decay 0.01).
double measure_torch(int64_t n, int reps) {
  auto p = torch::randn({n}).requires_grad_(true);
  p.mutable_grad() = torch::randn({n}) * 1e-3;
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  const double s = median_seconds(reps, [&] { opt.step(); });
  return static_cast<double>(n) / s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "all";
  bool raised = false;
  int64_t n = int64_t{1} << 25;
  int reps = 9;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "all" || a == "torch") mode = a;
    else if (a == "raised") raised = true;
    else if (a.rfind("params=", 0) == 0) n = std::stoll(a.substr(7));
    else if (a.rfind("reps=", 0) == 0) reps = std::stoi(a.substr(5));
    else {
      std::fprintf(stderr, "usage: bench_cpu_adam [all | torch [raised]] [params=N] [reps=R]\n");
      return 2;
    }
  }
  if (raised) {
    // Before any large allocation: every temporary of the step then comes from the heap.
    if (mallopt(M_MMAP_THRESHOLD, 1 << 30) != 1 || mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1) {
      std::fprintf(stderr, "mallopt refused the thresholds\n");
      return 1;
    }
  }
  const int threads = cpus_available();
  at::set_num_threads(threads);
  std::printf("threads %d\nparams %lld\nreps %d\n", threads, static_cast<long long>(n), reps);

  if (mode == "torch") {
    std::printf("%s %.4g\n", raised ? "torch_adamw_raised_updates_per_s" : "torch_adamw_updates_per_s",
                measure_torch(n, reps));
    return 0;
  }

  const Triad triad = measure_triad(threads, reps);
  const double bw = std::max(triad.plain_bytes_per_s, triad.stream_bytes_per_s);
  const double limit = bw / 28.0, limit_bf16 = bw / 30.0;
  std::printf("isa %s\n", cpu_adam::isa_name(cpu_adam::detect_isa()));
  std::printf("triad_plain_bytes_per_s %.4g\ntriad_stream_bytes_per_s %.4g\n", triad.plain_bytes_per_s,
              triad.stream_bytes_per_s);
  std::printf("limit_updates_per_s %.4g\n", limit);
  const double traffic = measure_traffic7(threads, n, reps);
  std::printf("traffic7_updates_per_s %.4g\n", traffic);
  const double ours = measure_ours(n, reps, cpu_adam::CopyOut::kNone);
  std::printf("ours_updates_per_s %.4g\n", ours);
  const double ours_bf16 = measure_ours(n, reps, cpu_adam::CopyOut::kBf16);
  std::printf("ours_bf16_updates_per_s %.4g\n", ours_bf16);
  const double torch_as_is = measure_torch(n, reps);
  std::printf("torch_adamw_updates_per_s %.4g\n", torch_as_is);
  std::printf("ratio_ours_torch %.3f\n", ours / torch_as_is);
  std::printf("ratio_ours_limit %.3f\n", ours / limit);
  std::printf("ratio_ours_bf16_limit %.3f\n", ours_bf16 / limit_bf16);
  std::printf("ratio_ours_traffic7 %.3f\n", ours / traffic);
  return 0;
}
