// The CPU kernels' thread pool (see worker_pool.h): each job is one OpenMP parallel region.
#include "polytrain/optim/worker_pool.h"

#include <unistd.h>

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
class WorkerPool {
 public:
  void run(RangeFn fn, const void* ctx, int64_t units, int parts, bool team_lost) {
    std::unique_lock<std::mutex> exclusive(run_mu_, std::try_to_lock);
    if (parts <= 1 || !exclusive.owns_lock() || team_lost) {
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

 private:
  std::mutex run_mu_;  // held by the caller for a whole job
};

/// This process's pool. Never destroyed; a child made by fork() makes a new one and leaves the
/// old alone (its mutex may have been held by a thread the child does not have).
WorkerPool& pool() {
  static std::mutex mu;
  static WorkerPool* current = nullptr;
  static pid_t owner = -1;
  std::lock_guard<std::mutex> lock(mu);
  const pid_t pid = ::getpid();
  if (current == nullptr || owner != pid) {
    current = new WorkerPool;
    owner = pid;
  }
  return *current;
}

/// The process that started an OpenMP team through this pool (0: none yet). In a child forked
/// after it, GNU OpenMP would hand a region to team threads the child does not have and wait for
/// them forever: there the jobs run on the calling thread.
std::atomic<pid_t> g_team_pid{0};

}  // namespace

void run(RangeFn fn, const void* ctx, int64_t units, int parts) {
  const pid_t pid = ::getpid();
  pid_t team = g_team_pid.load(std::memory_order_relaxed);
  if (team == 0 && parts > 1) {
    g_team_pid.compare_exchange_strong(team, pid);
    team = g_team_pid.load();
  }
  pool().run(fn, ctx, units, parts, team != 0 && team != pid);
}

int parts_for(int64_t units, int64_t grain) {
  if (at::in_parallel_region() || units <= 0) return 1;
  const int64_t wanted = (units + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), wanted)));
}

}  // namespace polytrain::cpu_pool
