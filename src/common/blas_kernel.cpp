#include "polytrain/common/blas_kernel.h"

#include <dlfcn.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

namespace polytrain {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

bool iequal(const std::string& a, const char* b) { return strcasecmp(a.c_str(), b) == 0; }

// The newest instruction set a kernel family uses: 1 SSE3, 2 AVX, 3 AVX2+FMA, 4 AVX-512;
// -1 for a name this table does not know (left alone). OpenBLAS 0.3.21's x86-64 core names.
int core_tier(const std::string& core) {
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (iequal(core, c)) return 4;
  for (const char* c : {"Haswell", "Zen", "Excavator"})
    if (iequal(core, c)) return 3;
  for (const char* c : {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller"})
    if (iequal(core, c)) return 2;
  for (const char* c : {"Unknown", "Katmai", "Coppermine", "Northwood", "Prescott", "Banias", "Atom", "Core2", "Penryn",
                        "Dunnington", "Nehalem", "Athlon", "Opteron", "Opteron_SSE3", "Barcelona", "Nano", "Bobcat"})
    if (iequal(core, c)) return 1;
  return -1;
}

int cpu_tier(const CpuFeatures& f) {
  if (f.avx512 && f.avx2 && f.fma) return 4;
  if (f.avx2 && f.fma) return 3;
  if (f.avx) return 2;
  return f.sse3 ? 1 : 0;
}

const char* kTierName[] = {"no SSE3", "SSE3", "AVX", "AVX2+FMA", "AVX-512"};
const char* kTierCore[] = {"", "", "Sandybridge", "Haswell", "SkylakeX"};

std::string corename_of(void* handle) {
  using fn = char* (*)();
  auto f = reinterpret_cast<fn>(dlsym(handle, "openblas_get_corename"));
  if (!f) return "";
  const char* c = f();
  return c ? trim(c) : "";
}

}  // namespace

CpuFeatures cpu_features_from_cpuinfo(const std::string& text) {
  CpuFeatures f;
  std::istringstream in(text);
  std::set<std::string> flags;
  bool seen_processor = false;
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) {
      if (seen_processor && trim(line).empty() && !flags.empty()) break;  // end of the first block
      continue;
    }
    const std::string key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
    if (key == "processor") {
      if (seen_processor) break;
      seen_processor = true;
    } else if (key == "vendor_id") {
      f.vendor = value;
    } else if (key == "model name") {
      f.model_name = value;
    } else if (key == "cpu family") {
      f.family = std::atoi(value.c_str());
    } else if (key == "model") {
      f.model = std::atoi(value.c_str());
    } else if (key == "flags") {
      std::istringstream words(value);
      for (std::string w; words >> w;) flags.insert(w);
    }
  }
  auto has = [&](const char* w) { return flags.count(w) > 0; };
  f.sse3 = has("pni");  // /proc/cpuinfo's name for SSE3
  f.avx = has("avx");
  f.avx2 = has("avx2");
  f.fma = has("fma");
  f.avx512 = has("avx512f") && has("avx512cd") && has("avx512bw") && has("avx512dq") && has("avx512vl");
  f.avx512_bf16 = has("avx512_bf16");
  f.amx_bf16 = has("amx_bf16") && has("amx_tile");
  return f;
}

CpuFeatures host_cpu_features() {
  // Read once per process (before main, by the kernel choice): the CPU does not change.
  static const CpuFeatures host = [] {
    std::ifstream in("/proc/cpuinfo");
    std::stringstream ss;
    ss << in.rdbuf();
    return cpu_features_from_cpuinfo(ss.str());
  }();
  return host;
}

std::string describe_cpu(const CpuFeatures& f) {
  std::string s = (f.vendor == "GenuineIntel" ? "Intel" : f.vendor == "AuthenticAMD" ? "AMD" : f.vendor);
  s += (s.empty() ? "" : " ") + std::string("family ") + std::to_string(f.family) + " model " + std::to_string(f.model);
  s += ", ";
  s += kTierName[cpu_tier(f)];
  if (f.avx512_bf16) s += ", AVX512-BF16";
  if (f.amx_bf16) s += ", AMX-BF16";
  return s;
}

std::string cpu_bf16_fallback_reason(const CpuFeatures& cpu, const char* env) {
  const std::string e = env ? env : "";
  if (e == "1") return "";
  if (e == "0") return "POLYTRAIN_CPU_BF16=0";
  if (cpu.avx512_bf16 || cpu.amx_bf16) return "";
  return "this CPU (" + describe_cpu(cpu) + ") has neither AVX512-BF16 nor AMX-BF16, so bf16 matmuls would be " +
         (cpu.avx512 ? "emulated (3x slower than fp32 for BERT-base)" : "unsupported by oneDNN") +
         "; POLYTRAIN_CPU_BF16=1 keeps bf16";
}

BlasKernelChoice choose_openblas_core(const CpuFeatures& cpu, const std::string& openblas_pick, const char* user_env) {
  if (user_env && *user_env) {
    // Kept, but a core older than the CPU is named: such a variable is often left over from
    // another machine (a VM image's environment), and it costs half the GEMM rate or more.
    std::string reason = std::string("OPENBLAS_CORETYPE=") + user_env + " from the environment";
    const int have = cpu_tier(cpu), forced = core_tier(user_env);
    if (forced >= 0 && forced < have && kTierCore[have][0] != 0)
      reason += std::string(", older than this CPU (") + kTierName[have] + ": " + kTierCore[have] + " would be faster)";
    return {"", reason};
  }
  if (openblas_pick.empty()) return {"", ""};
  const int have = cpu_tier(cpu), picked = core_tier(openblas_pick);
  if (picked < 0) return {"", "OpenBLAS's own pick (a core this choice does not know)"};
  if (picked >= 3 || picked >= have || kTierCore[have][0] == 0)
    return {"", "OpenBLAS's own pick for " + describe_cpu(cpu)};
  return {kTierCore[have], std::string("chosen by polytrain: OpenBLAS picked ") + openblas_pick + " for " +
                               describe_cpu(cpu) + "; set OPENBLAS_CORETYPE to choose another"};
}

std::string openblas_core_in_process() { return corename_of(RTLD_DEFAULT); }

const char* user_openblas_coretype() {
  const char* test = std::getenv("POLYTRAIN_TEST_OPENBLAS_FALLBACK");
  if (test && std::string(test) == "1") return nullptr;
  return std::getenv("OPENBLAS_CORETYPE");
}

std::string openblas_core_of_libblas() {
  if (const std::string here = openblas_core_in_process(); !here.empty()) return here;
  void* h = dlopen("libblas.so.3", RTLD_LAZY | RTLD_LOCAL);
  if (!h) return "";
  const std::string core = corename_of(h);
  dlclose(h);
  return core;
}

std::string blas_kernel_note() {
  const std::string core = openblas_core_in_process();
  if (core.empty()) return "";
  // kBlasChoiceEnv is "CORETYPE|reason" from whoever chose; it speaks for this process only while
  // OPENBLAS_CORETYPE is still what it chose (a user may have set another since).
  const char* chosen = std::getenv(kBlasChoiceEnv);
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  const std::string c = chosen ? chosen : "", set = env ? env : "";
  const auto bar = c.find('|');
  if (bar != std::string::npos && c.substr(0, bar) == set) return core + ", " + c.substr(bar + 1);
  return core + ", " + choose_openblas_core(host_cpu_features(), core, user_openblas_coretype()).reason;
}

std::string blas_kernel_env_value(const BlasKernelChoice& choice) { return choice.coretype + "|" + choice.reason; }

namespace {

// Before main (libpolytrain's load, after OpenBLAS's, which it depends on through libtorch):
// when OpenBLAS fell back to an older kernel than the CPU has, set OPENBLAS_CORETYPE and
// execute this program again from the start, with the same arguments and environment. OpenBLAS
// reads the variable only when it loads, so nothing short of a new image can change its pick.
// Nothing has run yet but static constructors, nothing printed, and the pid stays (a launcher
// or test supervising it sees the same process). Where the re-execution fails the process goes
// on with OpenBLAS's pick and the first line says so.
void reexec_for_blas_kernel() {
  const std::string core = openblas_core_in_process();
  if (core.empty()) return;
  // After the re-execution OPENBLAS_CORETYPE is set, and a set one is never overridden: no loop.
  const auto choice = choose_openblas_core(host_cpu_features(), core, user_openblas_coretype());
  if (choice.coretype.empty() || choice.coretype == core) return;
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<char*> argv;
  if (cmdline.empty() || cmdline.back() != '\0') return;  // not readable, or cut short
  for (size_t at = 0; at < cmdline.size(); at = cmdline.find('\0', at) + 1) argv.push_back(&cmdline[at]);
  argv.push_back(nullptr);
  ::unsetenv("POLYTRAIN_TEST_OPENBLAS_FALLBACK");  // the new image sees a choice made, as on a real fall-back
  ::setenv("OPENBLAS_CORETYPE", choice.coretype.c_str(), 1);
  ::setenv(kBlasChoiceEnv, blas_kernel_env_value(choice).c_str(), 1);
  std::fflush(nullptr);
  ::execv("/proc/self/exe", argv.data());
  const std::string why = std::string("OpenBLAS's own pick: re-executing with OPENBLAS_CORETYPE=") + choice.coretype +
                          " failed (" + std::strerror(errno) + ")";
  ::unsetenv("OPENBLAS_CORETYPE");
  ::setenv(kBlasChoiceEnv, ("|" + why).c_str(), 1);
}

const bool g_blas_kernel_at_load = (reexec_for_blas_kernel(), true);

}  // namespace

}  // namespace polytrain
