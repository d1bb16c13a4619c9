// Which OpenBLAS kernel a process runs on, chosen from the CPU's features. OpenBLAS built with
// DYNAMIC_ARCH picks its kernels by CPU model at load; one that does not know the model (Debian's
// 0.3.21 on Intel family 6 model 207) falls back to its SSE3 "Prescott" kernels, half the speed
// or less. The choice is OPENBLAS_CORETYPE, read by OpenBLAS when it loads: the launcher sets it
// for the workers it starts, and a program run directly re-executes itself once with it set
// (reexec_for_blas_kernel, run before main). No torch: the launcher uses it too.
#pragma once

#include <string>

namespace polytrain {

/// The CPU as /proc/cpuinfo describes it (its first processor block): the flags are the ones the
/// kernel enabled, so AVX-512 the OS does not save is absent.
struct CpuFeatures {
  std::string vendor;      ///< "GenuineIntel", "AuthenticAMD", ...
  std::string model_name;  ///< "Intel(R) Xeon(R) Processor"
  int family = -1;
  int model = -1;
  bool sse3 = false, avx = false, avx2 = false, fma = false;
  bool avx512 = false;  ///< F, CD, BW, DQ and VL together (what OpenBLAS's SkylakeX kernels need)
  bool avx512_bf16 = false, amx_bf16 = false;
};

/// Parses /proc/cpuinfo text (the first processor block).
CpuFeatures cpu_features_from_cpuinfo(const std::string& text);

/// This machine's features (/proc/cpuinfo, read once; all false where it cannot be read).
CpuFeatures host_cpu_features();

/// "family 6 model 207, AVX-512, AVX512-BF16, AMX-BF16": what the decision and benchmarks print.
std::string describe_cpu(const CpuFeatures& f);

/// Whether bf16 autocast is worth running on this CPU: a reason to train in fp32 instead, empty
/// to keep bf16. Without AVX512-BF16 or AMX-BF16 oneDNN emulates bf16 matmuls (BERT-base: 3x
/// slower than fp32 with AVX-512 alone) or has none (AVX2: Debian's oneDNN 2.6 throws).
/// `env` is POLYTRAIN_CPU_BF16: "1" keeps bf16 anyway, "0" falls back on any CPU.
std::string cpu_bf16_fallback_reason(const CpuFeatures& cpu, const char* env);

/// The decision: `coretype` is the OPENBLAS_CORETYPE to run with, empty to leave OpenBLAS's own
/// pick; `reason` is one clause for the run's first line.
struct BlasKernelChoice {
  std::string coretype;
  std::string reason;
};

/// Chooses from the CPU's features, OpenBLAS's own pick (its core name, empty when the process
/// does not run on OpenBLAS) and the user's OPENBLAS_CORETYPE (null or empty when unset; it
/// wins). A kernel is chosen only when OpenBLAS fell back to a core older than the CPU's best
/// instruction set among SSE3 < AVX < AVX2+FMA (Haswell) < AVX-512 (SkylakeX); a recent pick
/// (Haswell, Zen, SkylakeX, ...) is left alone.
BlasKernelChoice choose_openblas_core(const CpuFeatures& cpu, const std::string& openblas_pick, const char* user_env);

/// OpenBLAS's core name in this process ("Prescott", "SkylakeX"), empty when OpenBLAS is not
/// loaded.
std::string openblas_core_in_process();

/// OpenBLAS's core name for a process that would load libblas.so.3 now: loads it (RTLD_LOCAL)
/// when it is not in the process already (the launcher, which has no BLAS). Empty when libblas.so.3
/// is not OpenBLAS or cannot be loaded.
std::string openblas_core_of_libblas();

/// The user's OPENBLAS_CORETYPE (null when unset). For the tests only,
/// POLYTRAIN_TEST_OPENBLAS_FALLBACK=1 makes a set one count as OpenBLAS's own pick instead (run
/// with OPENBLAS_CORETYPE=Prescott, a process sees what it would see on a CPU OpenBLAS does not
/// know, and the re-execution and the launcher's choice can be tested on any machine).
const char* user_openblas_coretype();

/// What the run's first line says about the kernel: "chosen by polytrain: ..." (this process or
/// the launcher chose it), "OPENBLAS_CORETYPE from the environment", or OpenBLAS's own pick with
/// why it was kept. Empty when the process does not run on OpenBLAS.
std::string blas_kernel_note();

/// The environment variable that carries a choice to the process it is made for (the launcher's
/// workers, or this process re-executed): "CORETYPE|reason", with OPENBLAS_CORETYPE=CORETYPE.
inline constexpr const char* kBlasChoiceEnv = "POLYTRAIN_BLAS_KERNEL";

/// The value of kBlasChoiceEnv for `choice`.
std::string blas_kernel_env_value(const BlasKernelChoice& choice);

}  // namespace polytrain
