// The CPU kernels' thread pool (see worker_pool.h): each job is one OpenMP parallel region.
#include "polytrain/optim/worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include <ATen/Parallel.h>
#include <omp.h>

namespace polytrain::cpu_pool {
namespace {

// The jobs run on OpenMP's own team, the threads oneDNN's and OpenBLAS's GEMMs and ATen's kernels
// run on. A pool of separate threads beside it oversubscribed the cores: after each GEMM OpenMP's
// workers spin for the next region (GOMP_SPINCOUNT) while the kernel that follows ran on this
// pool's threads, and the other way round (GPT-2 124M's CPU step was 12% slower).
std::mutex g_run_mu;  // held by the caller for a whole job

// Set before this process's first team. A child forked after it (pthread_atfork) has lost the
// team: GNU OpenMP would hand a region to threads the child does not have and wait for them
// forever, so there the jobs run on the calling thread. Its mutex is then never taken either (it
// may have been held by a thread the child does not have).
std::atomic<bool> g_team_started{false}, g_team_lost{false};
const int g_atfork = ::pthread_atfork(nullptr, nullptr, [] {
  if (g_team_started.load()) g_team_lost.store(true);
});

}  // namespace

void run(RangeFn fn, const void* ctx, int64_t units, int parts) {
  if (parts <= 1 || g_team_lost.load(std::memory_order_relaxed)) {
    fn(ctx, 0, units);
    return;
  }
  if (!g_team_started.load(std::memory_order_relaxed)) g_team_started.store(true);  // before the mutex
  std::unique_lock<std::mutex> exclusive(g_run_mu, std::try_to_lock);
  if (!exclusive.owns_lock()) {
    fn(ctx, 0, units);
    return;
  }
  const int64_t chunk = (units + parts - 1) / parts;
#pragma omp parallel num_threads(parts)
  {
    // Fewer threads than asked (OMP_THREAD_LIMIT, a nested region) take several parts each.
    const int threads = omp_get_num_threads();
    for (int part = omp_get_thread_num(); part < parts; part += threads) {
      const int64_t begin = std::min(units, part * chunk), end = std::min(units, begin + chunk);
      if (begin < end) fn(ctx, begin, end);
    }
  }
}

int parts_for(int64_t units, int64_t grain) {
  if (at::in_parallel_region() || units <= 0) return 1;
  const int64_t wanted = (units + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), wanted)));
}

}  // namespace polytrain::cpu_pool
