// The CPU's fp32 matrix products (aten::mm, addmm, addmm_, bmm and their out forms) on a
// faster engine than ATen's CPU kernels in Debian's libtorch, for every program that loads
// libpolytrain: the override is registered with the dispatcher when the library loads, so the
// models' layers and autograd's backward formulas reach it without a change of code.
// - oneDNN's sgemm (Debian's libdnnl, which libtorch itself depends on) for mm and addmm: at
//   GPT-2's shapes 2-14% above OpenBLAS's SkylakeX kernels on 2 cores (bench/blas_kernels.sh).
// - bmm split over the batch: ATen runs a batch's products one after another, each on every
//   thread, and the small ones of attention (256 x 256 x 64) reach a third of the GEMM rate;
//   one product per thread reaches it (2.3x on GPT-2's attention products).
// Anything else (other dtypes, devices, layouts that are no BLAS operand, aliasing outputs,
// tiny products) goes to ATen's own CPU kernel, which also raises ATen's errors.
#pragma once

#include <string>

#include "polytrain/common/blas_kernel.h"

namespace polytrain::cpu_gemm {

enum class Engine {
  kAten,    ///< no override: ATen's CPU kernels (POLYTRAIN_GEMM=aten)
  kBlas,    ///< mm/addmm stay ATen's (OpenBLAS); bmm split over the batch on BLAS's sgemm
  kOneDnn,  ///< mm/addmm on oneDNN's sgemm, bmm split over the batch on it
};

/// The choice, from the CPU, whether the build has oneDNN and POLYTRAIN_GEMM (`env`, null when
/// unset): the variable's engine when it names one (onednn becomes blas without oneDNN); else
/// oneDNN on a CPU with AVX-512 (measured faster than OpenBLAS on an Intel Xeon and on AMD's Zen
/// 5), and blas on older CPUs (AVX2 only: not measured; bench/blas_kernels.sh decides there).
Engine choose_engine(const CpuFeatures& cpu, bool have_onednn, const char* env);

/// The engine in use: choose_engine for this machine, made once when the library loads.
Engine engine();

/// For the tests and benchmarks: switches the engine (kOneDnn only where the build has it) and
/// returns the one before.
Engine set_engine(Engine e);

/// Whether this build has oneDNN's sgemm.
bool have_onednn();

/// "oneDNN 2.6.3 sgemm (avx512_core_amx), bmm over the batch" for the run's first line.
/// Throws InputError naming POLYTRAIN_GEMM when it holds something else than the three names.
std::string describe();

}  // namespace polytrain::cpu_gemm
