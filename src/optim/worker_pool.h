// The thread pool the CPU kernels run on (cpu_adam.h, cpu_dropout.h, cpu_ops.h, the 8-bit
// optimizers, bmm): a range of work units cut into contiguous parts, each job one OpenMP parallel
// region on the team libtorch's GEMMs and ATen's kernels use. Leaves what a unit is to the caller.
//
// Why not at::parallel_for: it is a header template whose OpenMP body only exists when the
// including file is compiled with -fopenmp, which polytrain's files are not (it would run
// serially here); only worker_pool.cpp is. Why not threads of its own: beside OpenMP's, which
// spin for a while after each region, they oversubscribed the cores. The number of parts
// follows at::get_num_threads(), what at::set_num_threads sets.
//
// GNU OpenMP's team does not survive fork(): a child forked after its parent ran a region on
// several threads waits forever for threads it does not have. In a child forked after this pool
// started a team, jobs therefore run on the calling thread. libtorch's own OpenMP kernels (GEMMs
// above a few thousand products) have no such guard: such a child keeps 1 thread
// (at::set_num_threads(1)) or execs, as the launcher's workers do.
#pragma once

#include <cstdint>

namespace polytrain::cpu_pool {

/// fn(ctx, begin, end) over units [begin, end).
using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

/// Runs fn over [0, units) cut into `parts` contiguous ranges of equal size (the last one
/// shorter), part i on thread i of an OpenMP team of `parts` (the caller is thread 0; a smaller
/// team takes several parts a thread), and returns when all are done. One job at a time: a caller
/// that finds the pool busy (another thread's job) runs its job alone, on its own thread. parts
/// <= 1 runs fn(ctx, 0, units) inline. An exception thrown by fn is not supported (it would end
/// the process; kernels do not throw).
void run(RangeFn fn, const void* ctx, int64_t units, int parts);

/// How many parts `units` units make with at least `grain` units a part: at most
/// at::get_num_threads(), at least 1, and 1 inside an ATen parallel region.
int parts_for(int64_t units, int64_t grain);

}  // namespace polytrain::cpu_pool
