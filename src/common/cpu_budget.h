// How many CPU threads a process should use, and which allocator it runs on. No torch: the
// launcher (which splits the cores among the workers it starts) uses it too.
#pragma once

#include <string>

namespace polytrain {

/// CPUs this process may run on: its affinity mask, capped by the cgroup's CPU quota
/// (cgroup v2 cpu.max or v1 cfs_quota_us / cfs_period_us, rounded up), at least 1.
int available_cpus();

/// The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or 0 when there is none.
double cgroup_cpu_quota();

/// The same, read from a /proc/PID/cgroup file and a cgroup mount (for tests).
double cgroup_cpu_quota_from(const std::string& proc_self_cgroup, const std::string& fs_root);

/// Threads for this process when nothing else is said: configured (> 0) wins, then a valid
/// OMP_NUM_THREADS, then available_cpus() / LOCAL_WORLD_SIZE (the processes the launcher
/// started on this host), at least 1. `source` (optional) says which rule decided.
int default_thread_count(long long configured, std::string* source = nullptr);

/// Which BLAS the process runs on: OpenBLAS's or MKL's own description, else the library file.
std::string blas_description();

/// "tcmalloc (gperftools 2.10)" when tcmalloc is the process's malloc, else "glibc malloc" plus the
/// thresholds polytrain set (see tune_system_allocator).
std::string allocator_description();

/// When the process runs on glibc's malloc: raises its mmap and trim thresholds so that large
/// tensors are reused instead of returned to the kernel on every free (unless the user set
/// MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_). Idempotent; does nothing under tcmalloc.
void tune_system_allocator();

}  // namespace polytrain
