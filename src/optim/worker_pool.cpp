// The CPU kernels' thread pool (see worker_pool.h): workers sleep on a condition variable
// between jobs; the caller takes the first part of each job itself.
#include "polytrain/optim/worker_pool.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <ATen/Parallel.h>

namespace polytrain::cpu_pool {
namespace {

class WorkerPool {
 public:
  void run(RangeFn fn, const void* ctx, int64_t units, int parts) {
    std::unique_lock<std::mutex> exclusive(run_mu_, std::try_to_lock);
    if (parts <= 1 || !exclusive.owns_lock()) {
      fn(ctx, 0, units);
      return;
    }
    const int64_t chunk = (units + parts - 1) / parts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (started_ < parts - 1) {  // counted once running (a failed start throws, leaving none)
        std::thread([this, index = started_ + 1] { work(index); }).detach();
        ++started_;
      }
      fn_ = fn;
      ctx_ = ctx;
      units_ = units;
      chunk_ = chunk;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(ctx, 0, std::min(chunk, units));
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void work(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= parts_) continue;  // not needed this time
      const RangeFn fn = fn_;
      const void* ctx = ctx_;
      const int64_t begin = std::min(units_, index * chunk_), end = std::min(units_, begin + chunk_);
      lock.unlock();
      if (begin < end) fn(ctx, begin, end);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;  // held by the caller for a whole job
  std::mutex mu_;      // guards everything below
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  int started_ = 0, parts_ = 0, pending_ = 0;
  RangeFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t units_ = 0, chunk_ = 0;
};

/// This process's pool. Never destroyed (its threads may still wait at exit); a child made by
/// fork() has none of the parent's threads, so it makes a new one and leaves the old alone.
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

}  // namespace

void run(RangeFn fn, const void* ctx, int64_t units, int parts) { pool().run(fn, ctx, units, parts); }

int parts_for(int64_t units, int64_t grain) {
  if (at::in_parallel_region() || units <= 0) return 1;
  const int64_t wanted = (units + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), wanted)));
}

}  // namespace polytrain::cpu_pool
