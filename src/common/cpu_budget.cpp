#include "polytrain/common/cpu_budget.h"

#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "polytrain/common/dist_env.h"

// tcmalloc's version query: resolved at load time when tcmalloc is in the process (linked in
// by POLYTRAIN_ALLOCATOR=tcmalloc, or preloaded), null otherwise.
extern "C" const char* tc_version(int* major, int* minor, const char** patch) __attribute__((weak));

namespace polytrain {

using detail::cat;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks below it come
// from the heap and are reused; the trim threshold keeps freed heap memory for the next step.
constexpr int kMmapThreshold = 32 << 20;
constexpr int kTrimThreshold = 1 << 30;
bool g_tuned = false;

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}

// cgroup v2 "cpu.max": "max 100000" or "150000 100000".
double parse_cpu_max(const std::string& line) {
  std::istringstream in(line);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max" || period <= 0) return 0;
  char* end = nullptr;
  const double q = std::strtod(quota.c_str(), &end);
  return (end && *end == 0 && q > 0) ? q / period : 0;
}

}  // namespace

double cgroup_cpu_quota_from(const std::string& proc_self_cgroup, const std::string& fs_root) {
  std::ifstream f(proc_self_cgroup);
  std::string line;
  double best = 0;
  auto take = [&best](double q) {
    if (q > 0 && (best == 0 || q < best)) best = q;
  };
  while (std::getline(f, line)) {
    // "hierarchy-id:controllers:path"
    const auto a = line.find(':');
    const auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (path.empty() || path[0] != '/') continue;
    // The effective quota is the smallest on the way from the process's group to the root.
    for (;;) {
      const std::string dir = path == "/" ? "" : path;
      if (controllers.empty()) {  // cgroup v2
        take(parse_cpu_max(read_first_line(fs_root + dir + "/cpu.max")));
      } else if (("," + controllers + ",").find(",cpu,") != std::string::npos) {  // v1
        for (const char* mount : {"/cpu,cpuacct", "/cpu", "/cpuacct,cpu"}) {
          const std::string q = read_first_line(fs_root + mount + dir + "/cpu.cfs_quota_us");
          const std::string p = read_first_line(fs_root + mount + dir + "/cpu.cfs_period_us");
          if (q.empty() || p.empty()) continue;
          const double qv = std::atof(q.c_str()), pv = std::atof(p.c_str());
          if (qv > 0 && pv > 0) take(qv / pv);
          break;
        }
      }
      if (path == "/") break;
      const auto slash = path.find_last_of('/');
      path = slash == 0 ? "/" : path.substr(0, slash);
    }
  }
  return best;
}

double cgroup_cpu_quota() { return cgroup_cpu_quota_from("/proc/self/cgroup", "/sys/fs/cgroup"); }

int available_cpus() {
  int n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const double quota = cgroup_cpu_quota();
  if (quota > 0) n = std::min(n, std::max(1, static_cast<int>(std::ceil(quota - 1e-9))));
  return std::max(1, n);
}

int default_thread_count(long long configured, std::string* source) {
  auto said = [source](const std::string& s) {
    if (source) *source = s;
  };
  if (configured > 0) {
    said("trainer.num_threads");
    return static_cast<int>(std::min<long long>(configured, 1 << 16));
  }
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && *omp) {
    // OpenMP allows a nesting list ("4,2"): the first level is this process's.
    char* end = nullptr;
    const long v = std::strtol(omp, &end, 10);
    if (end != omp && (*end == 0 || *end == ',') && v > 0 && v <= (1 << 16)) {
      said("OMP_NUM_THREADS");
      return static_cast<int>(v);
    }
  }
  int local = 1;
  try {
    local = std::max(1, read_dist_env().local_world_size);
  } catch (const std::exception&) {
    local = 1;  // a malformed job environment is reported by the backend that reads it
  }
  const int cpus = available_cpus();
  said(cat(cpus, " CPUs / ", local, " local process", local == 1 ? "" : "es"));
  return std::max(1, cpus / local);
}

std::string blas_description() {
  // OpenBLAS and MKL say what they are; otherwise the file libblas.so.3 resolved to.
  using config_fn = const char* (*)();
  if (auto f = reinterpret_cast<config_fn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    const char* c = f();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64"
    std::string d = c ? c : "OpenBLAS";
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
      if (line.find("openblas-openmp") != std::string::npos) return d + " (OpenMP)";
      if (line.find("openblas-pthread") != std::string::npos) return d + " (pthreads)";
    }
    return d;
  }
  using mkl_version_fn = void (*)(char*, int);
  if (auto f = reinterpret_cast<mkl_version_fn>(dlsym(RTLD_DEFAULT, "mkl_get_version_string"))) {
    char buf[256] = {};
    f(buf, sizeof buf - 1);
    return buf;
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto at = line.find('/');
    if (at != std::string::npos && line.find("libblas.so") != std::string::npos) return line.substr(at);
  }
  return "unknown";
}

std::string allocator_description() {
  if (tc_version) {
    int major = 0, minor = 0;
    const char* patch = nullptr;
    const char* v = tc_version(&major, &minor, &patch);  // "gperftools 2.10"
    return cat("tcmalloc (", v && *v ? std::string(v) : cat(major, ".", minor), ")");
  }
  if (kSanitized) return "the sanitizer's allocator";
  if (g_tuned) return cat("glibc malloc (mmap threshold ", kMmapThreshold >> 20, " MiB, trim threshold ", kTrimThreshold >> 20,
                          " MiB)");
  return "glibc malloc";
}

void tune_system_allocator() {
  if (g_tuned || tc_version || kSanitized) return;
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") ||
      std::getenv("GLIBC_TUNABLES")) {
    return;  // the user tuned glibc themselves
  }
  const bool ok = mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
  g_tuned = ok;
}

namespace {
// Every program that loads libpolytrain gets the tuning before main() (no-op under tcmalloc).
const bool g_tune_at_load = (tune_system_allocator(), true);
}  // namespace

}  // namespace polytrain
