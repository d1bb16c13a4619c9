// The thread pool the CPU kernels run on (cpu_adam.h, cpu_dropout.h and the 8-bit optimizers): a range
// of work units cut into contiguous parts, part 0 on the caller, the others on workers that are
// started once and then only woken. Leaves what a unit is to the caller.
//
// Why not at::parallel_for: it is a header template whose OpenMP body only exists when the
// including file is compiled with -fopenmp, which polytrain is not (it would run serially
// here). The number of parts follows at::get_num_threads(), what at::set_num_threads sets.
#pragma once

#include <cstdint>

namespace polytrain::cpu_pool {

/// fn(ctx, begin, end) over units [begin, end).
using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

/// Runs fn over [0, units) cut into `parts` contiguous ranges of equal size (the last one
/// shorter), part 0 on the calling thread, part i on worker i, and returns when all are done.
/// A job allocates nothing once the workers exist. One job at a time: a caller that finds the
/// pool busy (another thread's job) runs its job alone, on its own thread. parts <= 1 runs
/// fn(ctx, 0, units) inline. An exception thrown by fn is not supported (kernels do not throw).
void run(RangeFn fn, const void* ctx, int64_t units, int parts);

/// How many parts `units` units make with at least `grain` units a part: at most
/// at::get_num_threads(), at least 1, and 1 inside an ATen parallel region.
int parts_for(int64_t units, int64_t grain);

}  // namespace polytrain::cpu_pool
