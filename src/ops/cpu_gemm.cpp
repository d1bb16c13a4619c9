#include "polytrain/ops/cpu_gemm.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#ifndef POLYTRAIN_WITH_DNNL
#define POLYTRAIN_WITH_DNNL 0
#endif
#if POLYTRAIN_WITH_DNNL
#include <dnnl.h>
#endif

#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain::cpu_gemm {
namespace {

using at::Tensor;

// ---- the engine -------------------------------------------------------------------------------

const char* env_value() {
  const char* v = std::getenv("POLYTRAIN_GEMM");
  return v && *v ? v : nullptr;
}

std::optional<Engine> parse(const char* v) {
  if (std::strcmp(v, "aten") == 0) return Engine::kAten;
  if (std::strcmp(v, "blas") == 0) return Engine::kBlas;
  if (std::strcmp(v, "onednn") == 0) return Engine::kOneDnn;
  return std::nullopt;
}

std::atomic<Engine>& current() {
  static std::atomic<Engine> e{choose_engine(host_cpu_features(), have_onednn(), env_value())};
  return e;
}

// BLAS's Fortran sgemm, from the BLAS libtorch loaded (OpenBLAS on Debian). Column-major.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
SgemmFn blas_sgemm() {
  static const auto fn = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "sgemm_"));
  return fn;
}

// oneDNN's bf16 GEMM: exported by libdnnl (DNNL_API) without a declaration in its public
// headers, so found at run time; null where this oneDNN has none.
using Bf16GemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*,
                           int64_t, float, float*, int64_t);
Bf16GemmFn dnnl_bf16_gemm() {
  static const auto fn = reinterpret_cast<Bf16GemmFn>(POLYTRAIN_WITH_DNNL ? dlsym(RTLD_DEFAULT, "dnnl_gemm_bf16bf16f32") : nullptr);
  return fn;
}

// OpenMP's thread count of the calling thread, from the runtime libtorch loaded (null without one).
using OmpGetFn = int (*)();
using OmpSetFn = void (*)(int);
OmpGetFn omp_get() {
  static const auto fn = reinterpret_cast<OmpGetFn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  return fn;
}
OmpSetFn omp_set() {
  static const auto fn = reinterpret_cast<OmpSetFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  return fn;
}

// ---- operands -----------------------------------------------------------------------------------

// A 2-D matrix as a row-major BLAS operand: its data, 'N' (rows contiguous) or 'T' (columns
// contiguous, i.e. the transpose of a row-major matrix) and its leading dimension.
struct Operand {
  const float* data;
  char trans;
  int64_t ld;
};

std::optional<Operand> operand(const float* data, int64_t rows, int64_t cols, int64_t s0, int64_t s1) {
  if ((s1 == 1 || cols == 1) && (rows == 1 || s0 >= cols)) return Operand{data, 'N', rows == 1 ? cols : s0};
  if ((s0 == 1 || rows == 1) && (cols == 1 || s1 >= rows)) return Operand{data, 'T', cols == 1 ? rows : s1};
  return std::nullopt;
}

// C[m, n] (row-major, leading dimension ldc) = alpha op(A) op(B) + beta C; beta 0 ignores C.
void gemm(Engine e, const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k, float alpha, float beta,
          float* c, int64_t ldc) {
#if POLYTRAIN_WITH_DNNL
  if (e == Engine::kOneDnn) {
    const dnnl_status_t st = dnnl_sgemm(a.trans, b.trans, m, n, k, alpha, a.data, a.ld, b.data, b.ld, beta, c, ldc);
    TORCH_CHECK(st == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(st));
    return;
  }
#endif
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  const int lda = static_cast<int>(b.ld), ldb = static_cast<int>(a.ld), ldci = static_cast<int>(ldc);
  blas_sgemm()(&b.trans, &a.trans, &mi, &ni, &ki, &alpha, b.data, &lda, a.data, &ldb, &beta, c, &ldci);
}

bool fits_blas_ints(std::initializer_list<int64_t> v) {
  return std::all_of(v.begin(), v.end(), [](int64_t x) { return x <= INT_MAX; });
}

bool plain_f32(const Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat;
}

// Below this many multiply-adds a call's fixed cost dominates and ATen's kernel is kept.
constexpr int64_t kMinMacs = 32 * 32 * 32;

// A row-major output block of m x n (leading dimension >= n).
bool row_major_out(const Tensor& c, int64_t m, int64_t n) {
  return plain_f32(c) && c.dim() == 2 && c.size(0) == m && c.size(1) == n && c.stride(1) == 1 &&
         (m == 1 || c.stride(0) >= n);
}

// ---- mm and addmm -----------------------------------------------------------------------------------

// The product of two matrices when the oneDNN engine runs it: both operands, m, n, k.
struct Product {
  Operand a, b;
  int64_t m, n, k;
};

std::optional<Product> onednn_product(const Tensor& a, const Tensor& b) {
  if (current().load(std::memory_order_relaxed) != Engine::kOneDnn) return std::nullopt;
  if (!plain_f32(a) || !plain_f32(b) || a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0)) return std::nullopt;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0 || k == 0 || m * n * k < kMinMacs) return std::nullopt;
  const auto oa = operand(a.data_ptr<float>(), m, k, a.stride(0), a.stride(1));
  const auto ob = operand(b.data_ptr<float>(), k, n, b.stride(0), b.stride(1));
  if (!oa || !ob) return std::nullopt;
  // A row-major A times a transposed B with a long inner dimension (the input gradient of a
  // layer that widens: GPT-2's MLP and QKV projections) runs at 93-99% of OpenBLAS's rate on
  // oneDNN; every other orientation at GPT-2's shapes runs 2-14% faster there.
  if (oa->trans == 'N' && ob->trans == 'T' && k > n) return std::nullopt;
  return Product{*oa, *ob, m, n, k};
}

bool aliases(const Tensor& out, const Tensor& a, const Tensor& b) { return out.is_alias_of(a) || out.is_alias_of(b); }

Tensor mm(const Tensor& self, const Tensor& mat2) {
  const auto p = onednn_product(self, mat2);
  if (!p) return at::cpu::mm(self, mat2);
  Tensor out = at::empty({p->m, p->n}, self.options());
  gemm(Engine::kOneDnn, p->a, p->b, p->m, p->n, p->k, 1.0f, 0.0f, out.data_ptr<float>(), p->n);
  return out;
}

Tensor& mm_out(const Tensor& self, const Tensor& mat2, Tensor& out) {
  const auto p = onednn_product(self, mat2);
  if (!p || !row_major_out(out, p->m, p->n) || aliases(out, self, mat2)) return at::cpu::mm_out(out, self, mat2);
  gemm(Engine::kOneDnn, p->a, p->b, p->m, p->n, p->k, 1.0f, 0.0f, out.data_ptr<float>(), out.stride(0));
  return out;
}

bool real_scalars(const at::Scalar& beta, const at::Scalar& alpha) { return !beta.isComplex() && !alpha.isComplex(); }

// Whether oneDNN runs beta self + alpha p: real scalars and an fp32 self that broadcasts to
// [m, n] (otherwise ATen's kernel runs it, and raises its own error).
bool addmm_fits(const Product& p, const Tensor& self, const at::Scalar& beta, const at::Scalar& alpha) {
  return real_scalars(beta, alpha) && plain_f32(self) && at::is_expandable_to(self.sizes(), {p.m, p.n});
}

// out = beta self + alpha p into a row-major `out`; self is copied in first unless out is self
// or beta is 0 (ATen's semantics: beta 0 ignores self, NaN included).
void addmm_into(const Product& p, const Tensor& self, const at::Scalar& beta, const at::Scalar& alpha, Tensor& out) {
  const float b = beta.toFloat();
  if (!out.is_same(self) && b != 0.0f) out.copy_(self.expand({p.m, p.n}));
  gemm(Engine::kOneDnn, p.a, p.b, p.m, p.n, p.k, alpha.toFloat(), b, out.data_ptr<float>(), out.stride(0));
}

Tensor& addmm_out(const Tensor& self, const Tensor& mat1, const Tensor& mat2, const at::Scalar& beta,
                  const at::Scalar& alpha, Tensor& out) {
  const auto p = onednn_product(mat1, mat2);
  if (!p || !addmm_fits(*p, self, beta, alpha) || !row_major_out(out, p->m, p->n) || aliases(out, mat1, mat2) ||
      (!out.is_same(self) && out.is_alias_of(self)))
    return at::cpu::addmm_out(out, self, mat1, mat2, beta, alpha);
  addmm_into(*p, self, beta, alpha, out);
  return out;
}

Tensor addmm(const Tensor& self, const Tensor& mat1, const Tensor& mat2, const at::Scalar& beta,
             const at::Scalar& alpha) {
  const auto p = onednn_product(mat1, mat2);
  if (!p || !addmm_fits(*p, self, beta, alpha)) return at::cpu::addmm(self, mat1, mat2, beta, alpha);
  Tensor out = at::empty({p->m, p->n}, mat1.options());
  addmm_into(*p, self, beta, alpha, out);
  return out;
}

Tensor& addmm_(Tensor& self, const Tensor& mat1, const Tensor& mat2, const at::Scalar& beta, const at::Scalar& alpha) {
  const auto p = onednn_product(mat1, mat2);
  if (!p || !real_scalars(beta, alpha) || !row_major_out(self, p->m, p->n) || aliases(self, mat1, mat2))
    return at::cpu::addmm_(self, mat1, mat2, beta, alpha);
  addmm_into(*p, self, beta, alpha, self);
  return self;
}

// ---- bmm -----------------------------------------------------------------------------------------

// One product per thread when the batch divides among the threads (or is long enough for the
// remainder not to matter) and each product is small enough that one thread runs it at the
// GEMM rate; otherwise ATen's loop, each product on every thread.
bool split_over_batch(int64_t batch, int64_t macs_each) {
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || batch < threads || at::in_parallel_region()) return false;
  if (batch % threads != 0 && batch < 4 * threads) return false;
  return macs_each <= int64_t{512} * 512 * 512;
}

// A bmm the batch split runs: the engine, both operands of item 0 and the batch strides.
struct BatchPlan {
  Engine engine;
  Operand a, b;
  int64_t batch, m, n, k, stride_a, stride_b;
};

std::optional<BatchPlan> batch_plan(const Tensor& self, const Tensor& mat2) {
  const Engine e = current().load(std::memory_order_relaxed);
  if (e == Engine::kAten || (e == Engine::kBlas && !blas_sgemm())) return std::nullopt;
  if (!plain_f32(self) || !plain_f32(mat2) || self.dim() != 3 || mat2.dim() != 3) return std::nullopt;
  const int64_t batch = self.size(0), m = self.size(1), k = self.size(2), n = mat2.size(2);
  if (mat2.size(0) != batch || mat2.size(1) != k || m == 0 || n == 0 || k == 0) return std::nullopt;
  if (m * n * k < kMinMacs || !split_over_batch(batch, m * n * k)) return std::nullopt;
  if (e == Engine::kBlas && !fits_blas_ints({m, n, k, self.stride(1), self.stride(2), mat2.stride(1), mat2.stride(2)}))
    return std::nullopt;
  const auto oa = operand(self.data_ptr<float>(), m, k, self.stride(1), self.stride(2));
  const auto ob = operand(mat2.data_ptr<float>(), k, n, mat2.stride(1), mat2.stride(2));
  if (!oa || !ob) return std::nullopt;
  return BatchPlan{e, *oa, *ob, batch, m, n, k, self.stride(0), mat2.stride(0)};
}

struct BatchJob {
  const BatchPlan* plan;
  float* c;
};

// Products [begin, end) on one pool thread, each on that thread alone.
void run_batch_part(const void* ctx, int64_t begin, int64_t end) {
  const BatchJob& j = *static_cast<const BatchJob*>(ctx);
  const BatchPlan& p = *j.plan;
  const SingleThreaded one;
  for (int64_t i = begin; i < end; ++i) {
    Operand a = p.a, b = p.b;
    a.data += i * p.stride_a;
    b.data += i * p.stride_b;
    gemm(p.engine, a, b, p.m, p.n, p.k, 1.0f, 0.0f, j.c + i * p.m * p.n, p.n);
  }
}

// Into a contiguous [batch, m, n] `out`, the products split over cpu_pool's threads (not
// at::parallel_for: without -fopenmp it runs serially in polytrain's code).
void run_batch(const BatchPlan& p, Tensor& out) {
  const BatchJob job{&p, out.data_ptr<float>()};
  cpu_pool::run(run_batch_part, &job, p.batch, cpu_pool::parts_for(p.batch, 1));
}

Tensor bmm(const Tensor& self, const Tensor& mat2) {
  const auto p = batch_plan(self, mat2);
  if (!p) return at::cpu::bmm(self, mat2);
  Tensor out = at::empty({p->batch, p->m, p->n}, self.options());
  run_batch(*p, out);
  return out;
}

Tensor& bmm_out(const Tensor& self, const Tensor& mat2, Tensor& out) {
  const auto p = batch_plan(self, mat2);
  if (!p || !plain_f32(out) || out.sizes() != at::IntArrayRef{p->batch, p->m, p->n} || !out.is_contiguous() ||
      aliases(out, self, mat2))
    return at::cpu::bmm_out(out, self, mat2);
  run_batch(*p, out);
  return out;
}

// ---- registration ------------------------------------------------------------------------------

// Registering a kernel for a dispatch key that has one replaces it and warns once per
// operator; the replacement is the point, so the warnings are kept out of every program's output.
class QuietHandler : public c10::WarningHandler {
 public:
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning&) override {}
#else
  void process(const c10::SourceLocation&, const std::string&, const bool) override {}
#endif
};
#if TORCH_VERSION_MAJOR >= 2
using HandlerGuard = c10::WarningUtils::WarningHandlerGuard;
#else
using HandlerGuard = c10::Warning::WarningHandlerGuard;
#endif

bool install() {
  if (current().load() == Engine::kAten) return false;
  QuietHandler quiet;
  HandlerGuard guard(&quiet);
  static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
  lib.impl("mm", TORCH_FN(mm));
  lib.impl("mm.out", TORCH_FN(mm_out));
  lib.impl("addmm", TORCH_FN(addmm));
  lib.impl("addmm.out", TORCH_FN(addmm_out));
  lib.impl("addmm_", TORCH_FN(addmm_));
  lib.impl("bmm", TORCH_FN(bmm));
  lib.impl("bmm.out", TORCH_FN(bmm_out));
  return true;
}

// When libpolytrain loads: after libtorch, whose kernels these replace.
const bool installed = install();

}  // namespace

bool have_onednn() { return POLYTRAIN_WITH_DNNL != 0; }

SingleThreaded::SingleThreaded() {
  if (omp_get() && omp_set()) {
    saved_ = omp_get()();
    omp_set()(1);
  }
}

SingleThreaded::~SingleThreaded() {
  if (saved_ > 0) omp_set()(saved_);
}

void sgemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const Engine e = current().load(std::memory_order_relaxed) == Engine::kOneDnn ? Engine::kOneDnn : Engine::kBlas;
  PT_CHECK(e == Engine::kOneDnn || blas_sgemm(), "cpu_gemm::sgemm: no BLAS sgemm_ in this process");
  PT_CHECK(e == Engine::kOneDnn || fits_blas_ints({m, n, k, lda, ldb, ldc}), "cpu_gemm::sgemm: a size exceeds the BLAS's int");
  gemm(e, Operand{a, trans_a, lda}, Operand{b, trans_b, ldb}, m, n, k, alpha, beta, c, ldc);
}

bool bf16_gemm_fits(const CpuFeatures& cpu, bool with_onednn, Engine e) {
  return with_onednn && e == Engine::kOneDnn && cpu.avx512_bf16 && !cpu.amx_bf16;
}

bool bf16_gemm_available() {
  static const bool cpu_fits = bf16_gemm_fits(host_cpu_features(), have_onednn(), Engine::kOneDnn);
  return cpu_fits && dnnl_bf16_gemm() && current().load(std::memory_order_relaxed) == Engine::kOneDnn;
}

void gemm_bf16(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a,
               int64_t lda, const c10::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  PT_CHECK(bf16_gemm_available(), "cpu_gemm::gemm_bf16: oneDNN's bf16 GEMM does not run here");
  const int st = dnnl_bf16_gemm()(trans_a, trans_b, m, n, k, alpha, reinterpret_cast<const uint16_t*>(a), lda,
                                  reinterpret_cast<const uint16_t*>(b), ldb, beta, c, ldc);
  TORCH_CHECK(st == 0, "oneDNN bf16 gemm failed with status ", st);
}

Engine choose_engine(const CpuFeatures& cpu, bool with_onednn, const char* env) {
  if (env && *env)
    if (const auto e = parse(env)) return *e == Engine::kOneDnn && !with_onednn ? Engine::kBlas : *e;
  // oneDNN on AVX-512, whatever the vendor: measured ahead of OpenBLAS at GPT-2's shapes on an
  // Intel Xeon (+13%) and on AMD's Zen 5 (+4%, both against OpenBLAS's AVX-512 kernels).
  // Without AVX-512 the batch split alone, whose gain does not depend on the library.
  return with_onednn && cpu.avx512 ? Engine::kOneDnn : Engine::kBlas;
}

Engine engine() { return current().load(); }

Engine set_engine(Engine e) {
  if (e == Engine::kOneDnn && !have_onednn()) e = Engine::kBlas;
  // A process that started with POLYTRAIN_GEMM=aten has no override to switch.
  if (!installed) return Engine::kAten;
  return current().exchange(e);
}

std::string describe() {
  if (const char* v = env_value(); v && !parse(v))
    throw InputError(std::string("POLYTRAIN_GEMM=") + v + ": expected aten, blas or onednn");
  switch (engine()) {
    case Engine::kAten:
      return "ATen's";
    case Engine::kBlas:
      return "BLAS, bmm over the batch";
    case Engine::kOneDnn:
      break;
  }
#if POLYTRAIN_WITH_DNNL
  const dnnl_version_t* v = dnnl_version();
  std::string isa;
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: isa = "avx512_core_amx"; break;
    case dnnl_cpu_isa_avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl_cpu_isa_avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl_cpu_isa_avx512_core: isa = "avx512_core"; break;
    case dnnl_cpu_isa_avx2: isa = "avx2"; break;
    default: isa = "isa " + std::to_string(static_cast<int>(dnnl_get_effective_cpu_isa()));
  }
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " sgemm (" + isa + "), bmm over the batch";
#else
  return "BLAS, bmm over the batch";
#endif
}

}  // namespace polytrain::cpu_gemm
