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

#include <cstdint>
#include <string>

#include <c10/util/BFloat16.h>

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

/// C[m, n] = alpha op(A) op(B) + beta C on row-major operands ('N': A is m x k, rows `lda`
/// apart; 'T': A is stored k x m; the same for B; beta 0 ignores C) on the engine's library:
/// oneDNN's sgemm with kOneDnn, else the BLAS's. Both run it on as many threads as the calling
/// thread's OpenMP thread count; under SingleThreaded, on the calling thread alone. For kernels
/// that run many small products each on one thread of the pool (cpu_attention).
void sgemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// Whether gemm_bf16 runs on this CPU (bf16_gemm_fits) for the engine in use.
bool bf16_gemm_available();

/// Where oneDNN's bf16 GEMM API (dnnl_gemm_bf16bf16f32: fp32 accumulation and fp32 output)
/// replaces ATen's bf16 matmul (oneDNN's matmul primitive, bf16 output): a CPU with AVX512-BF16
/// and no AMX-BF16 (on AMX the primitive runs on the tiles and was measured there; the GEMM API
/// was not), a oneDNN build and the oneDNN engine. Measured on Zen 5 at GPT-2's LM-head shapes (1020 x
/// 50257 x 768, 2 threads): weight gradient 895 against 653 GFLOP/s, input gradient 931 against
/// 720.
bool bf16_gemm_fits(const CpuFeatures& cpu, bool have_onednn, Engine engine);

/// C[m, n] (fp32, row-major) = alpha op(A) op(B) + beta C for bf16 A and B (operands as
/// sgemm's) on oneDNN's bf16 GEMM, on the calling thread's OpenMP thread count. Requires
/// bf16_gemm_available().
void gemm_bf16(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a,
               int64_t lda, const c10::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// While alive, the calling thread's OpenMP thread count is 1 (libgomp's, which libtorch,
/// oneDNN and OpenBLAS share, found at run time), so the GEMM libraries run on this thread
/// alone; restored after. For a product inside a cpu_pool job (optim/worker_pool.h), where a
/// library's own threads would only oversubscribe the cores (an inactive nested region already
/// keeps it on one thread, unless OMP_MAX_ACTIVE_LEVELS allows nesting).
class SingleThreaded {
 public:
  SingleThreaded();
  ~SingleThreaded();
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;

 private:
  int saved_ = 0;
};

/// Whether this build has oneDNN's sgemm.
bool have_onednn();

/// "oneDNN 2.6.3 sgemm (avx512_core_amx), bmm over the batch" for the run's first line.
/// Throws InputError naming POLYTRAIN_GEMM when it holds something else than the three names.
std::string describe();

}  // namespace polytrain::cpu_gemm
