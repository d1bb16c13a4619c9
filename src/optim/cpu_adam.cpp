// DeepSpeed's CPU Adam (semantics of csrc/includes/cpu_adam.h, Step_1 / Step_AVX; written here
// from the formula, not from their code): one pass over p, g, m, v per step with the update
// and the optional bf16 / fp16 copy of the new weights fused in.
//
// Kernels: AVX-512 (F + BW; the detection also asks DQ, which the 8-bit kernels use) and
// AVX2 + FMA + F16C, as intrinsics in functions carrying their
// own target attribute, so this file builds with plain -O2 and runs on any x86-64 CPU; the
// one to run is chosen from cpuid + xgetbv at run time (cpu_adam.h: hardware_isa). A scalar
// kernel is the fallback and the only one off x86-64. A SIMD kernel runs its last partial
// vector through the same vector code on a zero-padded copy, so every element gets the same
// instruction sequence wherever it falls, and results do not depend on how the range is cut.
//
// Threads: the range is split over worker_pool.h's pool (at::parallel_for would run serially
// in a file built without -fopenmp), as many parts as at::get_num_threads(), the caller taking
// the first part.
//
// Also here: CpuAdam, the kernel behind polytrain's Optimizer interface for whole parameters,
// saving its state as libtorch's AdamWParamState does so checkpoints move between the two.
#include "polytrain/optim/cpu_adam.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain::cpu_adam {
namespace {

// ---- which kernel the CPU can run ----------------------------------------------------------

#if defined(__x86_64__)
Isa probe_cpu() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return Isa::kScalar;
  const bool fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
  if (!osxsave || !avx) return Isa::kScalar;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6) == 0x6;            // SSE + AVX state saved
  const bool os_zmm = (xcr0_lo & 0xE6) == 0xE6;          // + opmask, ZMM0-15 high, ZMM16-31
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  if (__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7) == 0) return Isa::kScalar;
  const bool avx2 = (b7 >> 5) & 1, avx512f = (b7 >> 16) & 1, avx512dq = (b7 >> 17) & 1, avx512bw = (b7 >> 30) & 1;
  if (!(os_ymm && avx2 && fma && f16c)) return Isa::kScalar;
  if (os_zmm && avx512f && avx512dq && avx512bw) return Isa::kAvx512;
  return Isa::kAvx2;
}
#else
Isa probe_cpu() { return Isa::kScalar; }
#endif

int rank(Isa isa) { return static_cast<int>(isa); }

// ---- the per-step constants ----------------------------------------------------------------

struct Consts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps;
  float step_size;    // lr / bc1
  float bias2_sqrt;   // sqrt(bc2)
  float l2;           // weight_decay, added to the gradient times param (Adam mode)
  float decay;        // -lr * weight_decay, times param added to param (AdamW mode)
  bool use_l2, use_decay;
};

Consts consts_of(const Hyper& h, int64_t step) {
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, wd = h.weight_decay;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  Consts c;
  c.beta1 = h.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - b1);
  c.beta2 = h.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  c.eps = h.eps;
  c.step_size = static_cast<float>(lr / bc1);
  c.bias2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.l2 = h.weight_decay;
  c.decay = static_cast<float>(-lr * wd);
  c.use_l2 = h.weight_decay > 0 && !h.adam_w_mode;
  c.use_decay = h.weight_decay > 0 && h.adam_w_mode;
  return c;
}

/// One step's arrays and constants, shared read-only by the threads.
struct Job {
  Consts c;
  float* p;
  const float* g;
  float* m;
  float* v;
  uint16_t* out;
  int64_t n;
  CopyOut copy;
  Isa isa;
};

// ---- scalar kernel ---------------------------------------------------------------------------

template <CopyOut C>
void range_scalar(const Job& j, int64_t begin, int64_t end) {
  const Consts& c = j.c;
  for (int64_t i = begin; i < end; ++i) {
    float g = j.g[i], p = j.p[i];
    if (c.use_l2) g = p * c.l2 + g;
    const float m = j.m[i] * c.beta1 + g * c.one_minus_beta1;
    const float v = j.v[i] * c.beta2 + g * g * c.one_minus_beta2;
    const float denom = std::sqrt(v) / c.bias2_sqrt + c.eps;
    if (c.use_decay) p = p + p * c.decay;
    p = p - c.step_size * (m / denom);
    j.p[i] = p;
    j.m[i] = m;
    j.v[i] = v;
    if constexpr (C == CopyOut::kBf16) j.out[i] = c10::BFloat16(p).x;
    if constexpr (C == CopyOut::kFp16) j.out[i] = c10::Half(p).x;
  }
}

#if defined(__x86_64__)
#define PT_AVX512 __attribute__((target("avx512f,avx512bw")))
#define PT_AVX2 __attribute__((target("avx2,fma,f16c")))

// GCC 12 reports its own _mm512_undefined_*() placeholders inside the intrinsics as "may be
// used uninitialized" when they are inlined into a target("avx512f") function (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// ---- AVX-512 kernel: 16 floats a vector ---------------------------------------------------------

struct K512 {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt, l2, decay;
};

PT_AVX512 inline K512 broadcast512(const Consts& c) {
  return {_mm512_set1_ps(c.beta1),     _mm512_set1_ps(c.one_minus_beta1), _mm512_set1_ps(c.beta2),
          _mm512_set1_ps(c.one_minus_beta2), _mm512_set1_ps(c.eps),      _mm512_set1_ps(c.step_size),
          _mm512_set1_ps(c.bias2_sqrt), _mm512_set1_ps(c.l2),              _mm512_set1_ps(c.decay)};
}

/// c10::BFloat16(float) on 16 lanes: round to nearest even by the carry trick, NaN -> 0x7FC0.
PT_AVX512 inline __m256i to_bf16_512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

/// c10::Half(float) on 16 lanes: F16C's round to nearest even agrees with c10 except that it
/// keeps NaN payload bits where c10 writes sign | 0x7E00; NaN lanes are patched (rare path).
PT_AVX512 inline __m256i to_fp16_512(__m512 x) {
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (nan != 0) {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(0x8000));
    const __m512i fix = _mm512_or_si512(sign, _mm512_set1_epi32(0x7E00));
    h = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_cvtepu16_epi32(h), nan, fix));
  }
  return h;
}

template <CopyOut C>
PT_AVX512 inline void block512(const K512& k, bool use_l2, bool use_decay, float* pp, const float* gp, float* mp,
                               float* vp, uint16_t* op) {
  __m512 g = _mm512_loadu_ps(gp);
  __m512 p = _mm512_loadu_ps(pp);
  if (use_l2) g = _mm512_fmadd_ps(p, k.l2, g);
  const __m512 m = _mm512_fmadd_ps(g, k.one_minus_beta1, _mm512_mul_ps(_mm512_loadu_ps(mp), k.beta1));
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(g, g), k.one_minus_beta2, _mm512_mul_ps(_mm512_loadu_ps(vp), k.beta2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.bias2_sqrt), k.eps);
  if (use_decay) p = _mm512_fmadd_ps(p, k.decay, p);
  p = _mm512_fnmadd_ps(k.step_size, _mm512_div_ps(m, denom), p);
  _mm512_storeu_ps(pp, p);
  _mm512_storeu_ps(mp, m);
  _mm512_storeu_ps(vp, v);
  if constexpr (C == CopyOut::kBf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(op), to_bf16_512(p));
  if constexpr (C == CopyOut::kFp16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(op), to_fp16_512(p));
}

template <CopyOut C>
PT_AVX512 void range_avx512(const Job& j, int64_t begin, int64_t end) {
  const K512 k = broadcast512(j.c);
  const bool l2 = j.c.use_l2, decay = j.c.use_decay;
  // Locals, not j's members: the stores below could alias a Job as far as the compiler knows.
  float* const pp = j.p;
  const float* const gp = j.g;
  float* const mp = j.m;
  float* const vp = j.v;
  uint16_t* const op = j.out;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16)
    block512<C>(k, l2, decay, pp + i, gp + i, mp + i, vp + i, C == CopyOut::kNone ? nullptr : op + i);
  if (i == end) return;
  // The last partial vector: through the same code on a zero-padded copy.
  const size_t r = static_cast<size_t>(end - i);
  alignas(64) float p[16] = {}, g[16] = {}, m[16] = {}, v[16] = {};
  alignas(64) uint16_t o[16] = {};
  std::memcpy(p, j.p + i, r * 4);
  std::memcpy(g, j.g + i, r * 4);
  std::memcpy(m, j.m + i, r * 4);
  std::memcpy(v, j.v + i, r * 4);
  block512<C>(k, l2, decay, p, g, m, v, o);
  std::memcpy(j.p + i, p, r * 4);
  std::memcpy(j.m + i, m, r * 4);
  std::memcpy(j.v + i, v, r * 4);
  if (C != CopyOut::kNone) std::memcpy(j.out + i, o, r * 2);
}

// ---- AVX2 + FMA + F16C kernel: 8 floats a vector ------------------------------------------------

struct K256 {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt, l2, decay;
};

PT_AVX2 inline K256 broadcast256(const Consts& c) {
  return {_mm256_set1_ps(c.beta1),     _mm256_set1_ps(c.one_minus_beta1), _mm256_set1_ps(c.beta2),
          _mm256_set1_ps(c.one_minus_beta2), _mm256_set1_ps(c.eps),      _mm256_set1_ps(c.step_size),
          _mm256_set1_ps(c.bias2_sqrt), _mm256_set1_ps(c.l2),              _mm256_set1_ps(c.decay)};
}

/// 8 x u32 lanes holding 16-bit values -> 8 x u16, in order.
PT_AVX2 inline __m128i narrow_epi32(__m256i x) {
  // packus works per 128-bit half: [x0..x3 x0..x3 | x4..x7 x4..x7]; keep 64-bit words 0 and 2.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08));
}

PT_AVX2 inline __m128i to_bf16_256(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return narrow_epi32(r);
}

PT_AVX2 inline __m128i to_fp16_256(__m256 x) {
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(nan) != 0) {
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(0x8000));
    const __m256i fix = _mm256_or_si256(sign, _mm256_set1_epi32(0x7E00));
    const __m256i wide = _mm256_blendv_epi8(_mm256_cvtepu16_epi32(h), fix, _mm256_castps_si256(nan));
    h = narrow_epi32(wide);
  }
  return h;
}

template <CopyOut C>
PT_AVX2 inline void block256(const K256& k, bool use_l2, bool use_decay, float* pp, const float* gp, float* mp,
                             float* vp, uint16_t* op) {
  __m256 g = _mm256_loadu_ps(gp);
  __m256 p = _mm256_loadu_ps(pp);
  if (use_l2) g = _mm256_fmadd_ps(p, k.l2, g);
  const __m256 m = _mm256_fmadd_ps(g, k.one_minus_beta1, _mm256_mul_ps(_mm256_loadu_ps(mp), k.beta1));
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(g, g), k.one_minus_beta2, _mm256_mul_ps(_mm256_loadu_ps(vp), k.beta2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bias2_sqrt), k.eps);
  if (use_decay) p = _mm256_fmadd_ps(p, k.decay, p);
  p = _mm256_fnmadd_ps(k.step_size, _mm256_div_ps(m, denom), p);
  _mm256_storeu_ps(pp, p);
  _mm256_storeu_ps(mp, m);
  _mm256_storeu_ps(vp, v);
  if constexpr (C == CopyOut::kBf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(op), to_bf16_256(p));
  if constexpr (C == CopyOut::kFp16) _mm_storeu_si128(reinterpret_cast<__m128i*>(op), to_fp16_256(p));
}

template <CopyOut C>
PT_AVX2 void range_avx2(const Job& j, int64_t begin, int64_t end) {
  const K256 k = broadcast256(j.c);
  const bool l2 = j.c.use_l2, decay = j.c.use_decay;
  // Locals, not j's members: the stores below could alias a Job as far as the compiler knows.
  float* const pp = j.p;
  const float* const gp = j.g;
  float* const mp = j.m;
  float* const vp = j.v;
  uint16_t* const op = j.out;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8)
    block256<C>(k, l2, decay, pp + i, gp + i, mp + i, vp + i, C == CopyOut::kNone ? nullptr : op + i);
  if (i == end) return;
  const size_t r = static_cast<size_t>(end - i);
  alignas(32) float p[8] = {}, g[8] = {}, m[8] = {}, v[8] = {};
  alignas(32) uint16_t o[8] = {};
  std::memcpy(p, j.p + i, r * 4);
  std::memcpy(g, j.g + i, r * 4);
  std::memcpy(m, j.m + i, r * 4);
  std::memcpy(v, j.v + i, r * 4);
  block256<C>(k, l2, decay, p, g, m, v, o);
  std::memcpy(j.p + i, p, r * 4);
  std::memcpy(j.m + i, m, r * 4);
  std::memcpy(j.v + i, v, r * 4);
  if (C != CopyOut::kNone) std::memcpy(j.out + i, o, r * 2);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // __x86_64__

template <CopyOut C>
void range_for(const Job& j, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (j.isa == Isa::kAvx512) return range_avx512<C>(j, begin, end);
  if (j.isa == Isa::kAvx2) return range_avx2<C>(j, begin, end);
#endif
  range_scalar<C>(j, begin, end);
}

// Threads work on whole units of 16 elements (a cache line of each array) so that the parts'
// borders fall on vector and cache-line borders.
constexpr int64_t kUnit = 16;
constexpr int64_t kGrainUnits = 32768 / kUnit;  // at least 32K elements a thread

void run_units(const void* ctx, int64_t unit_begin, int64_t unit_end) {
  const Job& j = *static_cast<const Job*>(ctx);
  const int64_t begin = unit_begin * kUnit, end = std::min(unit_end * kUnit, j.n);
  switch (j.copy) {
    case CopyOut::kNone: return range_for<CopyOut::kNone>(j, begin, end);
    case CopyOut::kBf16: return range_for<CopyOut::kBf16>(j, begin, end);
    case CopyOut::kFp16: return range_for<CopyOut::kFp16>(j, begin, end);
  }
}

}  // namespace

Isa hardware_isa() {
  static const Isa isa = probe_cpu();
  return isa;
}

Isa detect_isa() {
  const Isa hw = hardware_isa();
  const char* env = std::getenv("POLYTRAIN_CPU_ADAM_ISA");
  if (env == nullptr || *env == '\0') return hw;
  std::string want(env);
  std::transform(want.begin(), want.end(), want.begin(), [](unsigned char c) { return std::tolower(c); });
  Isa asked;
  if (want == "scalar") asked = Isa::kScalar;
  else if (want == "avx2") asked = Isa::kAvx2;
  else if (want == "avx512") asked = Isa::kAvx512;
  else throw InputError(detail::cat("POLYTRAIN_CPU_ADAM_ISA must be scalar, avx2 or avx512, got '", env, "'"));
  return rank(asked) < rank(hw) ? asked : hw;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

void step(const Hyper& h, int64_t step, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
          int64_t n, CopyOut copy, uint16_t* out, Isa isa) {
  PT_CHECK(n >= 0, "cpu_adam::step over ", n, " elements");
  if (n == 0) return;
  PT_CHECK(step >= 1 || !h.bias_correction, "cpu_adam::step: step count ", step, " (1-based, incremented before the call)");
  PT_CHECK(param != nullptr && grad != nullptr && exp_avg != nullptr && exp_avg_sq != nullptr);
  PT_CHECK(copy == CopyOut::kNone || out != nullptr, "cpu_adam::step: copy-out asked without an output buffer");
  PT_CHECK(rank(isa) <= rank(hardware_isa()), "cpu_adam::step: the ", isa_name(isa),
           " kernel needs instructions this CPU (or OS) lacks; best available: ", isa_name(hardware_isa()));
  const Job job{consts_of(h, step), param, grad, exp_avg, exp_avg_sq, out, n, copy, isa};
  const int64_t units = (n + kUnit - 1) / kUnit;
  cpu_pool::run(&run_units, &job, units, cpu_pool::parts_for(units, kGrainUnits));
}

}  // namespace polytrain::cpu_adam

// ---- CpuAdam: the kernel behind polytrain's Optimizer ---------------------------------------------

namespace polytrain {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

class CpuAdam final : public Optimizer {
 public:
  CpuAdam(const OptimizerConfig& cfg, std::vector<ParamGroup> groups)
      : name_(cfg.type),
        lr_(cfg.lr),
        beta1_(cfg.beta1),
        beta2_(cfg.beta2),
        eps_(cfg.eps),
        adam_w_mode_(cfg.adam_w_mode || lower(cfg.type) == "adamw"),
        bias_correction_(cfg.bias_correction) {
    PT_INPUT_CHECK(cfg.lr >= 0, "optimizer.params.lr must be >= 0, got ", cfg.lr);
    PT_INPUT_CHECK(cfg.eps >= 0, "optimizer.params.eps must be >= 0, got ", cfg.eps);
    PT_INPUT_CHECK(cfg.weight_decay >= 0, "optimizer.params.weight_decay must be >= 0, got ", cfg.weight_decay);
    PT_INPUT_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1, "optimizer.params.betas[0] must be in [0, 1), got ", cfg.beta1);
    PT_INPUT_CHECK(cfg.beta2 >= 0 && cfg.beta2 < 1, "optimizer.params.betas[1] must be in [0, 1), got ", cfg.beta2);
    PT_INPUT_CHECK(!cfg.amsgrad, "optimizer.params.amsgrad is not supported by ", cfg.type,
                   " (DeepSpeed's CPU Adam has no AMSGrad)");
    std::unordered_map<const void*, std::string> seen;
    for (auto& g : groups) {
      PT_INPUT_CHECK(g.weight_decay >= 0, "optimizer: a parameter group has weight decay ", g.weight_decay);
      for (auto& [name, t] : g.params) {
        PT_INPUT_CHECK(t.defined(), name_, ": parameter '", name, "' is an undefined tensor");
        PT_INPUT_CHECK(t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == at::kFloat,
                       name_, " (CPU Adam) steps fp32 CPU parameters only; '", name, "' is ", t.scalar_type(), " on ",
                       t.device());
        PT_INPUT_CHECK(t.is_contiguous(), name_, " (CPU Adam) needs contiguous parameters; '", name,
                       "' is not (strides ", t.strides(), ")");
        auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), name);
        PT_INPUT_CHECK(fresh, name_, ": parameter '", name, "' is the same tensor as '", it->second,
                       "' (it would be stepped twice)");
        slot_of_[t.unsafeGetTensorImpl()] = slots_.size();
        slots_.push_back(Slot{name, t, {}, {}, static_cast<float>(g.weight_decay)});
      }
    }
  }

  std::string name() const override { return name_; }

  at::Tensor statistic(const at::Tensor& param, const std::string& name) override {
    if (name != "exp_avg" && name != "exp_avg_sq") Optimizer::statistic(param, name);  // throws
    const auto it = slot_of_.find(param.unsafeGetTensorImpl());
    if (it == slot_of_.end()) return at::Tensor();
    const Slot& s = slots_[it->second];
    return name == "exp_avg" ? s.exp_avg : s.exp_avg_sq;
  }

  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (const auto& s : slots_)
      if (s.exp_avg.defined()) bytes += (s.exp_avg.numel() + s.exp_avg_sq.numel()) * 4;
    return bytes;
  }

  void step() override {
    ++step_;
    cpu_adam::Hyper h;
    h.lr = static_cast<float>(lr_);
    h.beta1 = static_cast<float>(beta1_);
    h.beta2 = static_cast<float>(beta2_);
    h.eps = static_cast<float>(eps_);
    h.adam_w_mode = adam_w_mode_;
    h.bias_correction = bias_correction_;
    const cpu_adam::Isa isa = cpu_adam::detect_isa();
    for (auto& s : slots_) {
      at::Tensor g = s.param.grad();
      if (!g.defined()) continue;
      PT_INPUT_CHECK(g.layout() == at::kStrided && g.device().is_cpu() && g.scalar_type() == at::kFloat &&
                         g.sizes() == s.param.sizes(),
                     name_, ": the gradient of '", s.name, "' must be a dense fp32 CPU tensor of shape ",
                     s.param.sizes(), ", got ", g.scalar_type(), " ", g.sizes(), " on ", g.device());
      if (!g.is_contiguous()) g = g.contiguous();
      if (!s.exp_avg.defined()) {
        s.exp_avg = at::zeros_like(s.param, at::MemoryFormat::Contiguous);
        s.exp_avg_sq = at::zeros_like(s.param, at::MemoryFormat::Contiguous);
      }
      h.weight_decay = s.weight_decay;
      cpu_adam::step(h, step_, s.param.data_ptr<float>(), g.data_ptr<float>(), s.exp_avg.data_ptr<float>(),
                     s.exp_avg_sq.data_ptr<float>(), s.param.numel(), cpu_adam::CopyOut::kNone, nullptr, isa);
      // Written through the raw pointer: tell autograd the tensor changed, as an in-place op would.
      if (!s.param.is_inference()) s.param.unsafeGetTensorImpl()->bump_version();
    }
  }

  void zero_grad() override {
    for (auto& s : slots_)
      if (s.param.grad().defined()) s.param.mutable_grad().zero_();
  }

  void set_lr(double lr) override { lr_ = lr; }
  bool has_beta1() const override { return true; }
  void set_beta1(double beta1) override {
    check_scheduled_beta1(beta1);
    beta1_ = beta1;
  }

  torch::optim::Optimizer& torch_optimizer() override {
    throw InternalError("CPUAdam has no libtorch optimizer underneath");
  }

  // The layout of make_optimizer's AdamW: "names", then "s<i>" for each parameter that has
  // state, written by AdamWParamState itself ("step" an int, "exp_avg", "exp_avg_sq").
  void save(torch::serialize::OutputArchive& archive) const override {
    std::vector<std::string> names;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      names.push_back(s.name);
      if (!s.exp_avg.defined()) continue;
      torch::optim::AdamWParamState state;
      state.step(step_);
      state.exp_avg(s.exp_avg);
      state.exp_avg_sq(s.exp_avg_sq);
      torch::serialize::OutputArchive one;
      state.serialize(one);
      archive.write("s" + std::to_string(i), one);
    }
    archive.write("names", c10::IValue(c10::List<std::string>(names)));
  }

  void load(torch::serialize::InputArchive& archive, const std::string& origin) override {
    c10::IValue names_iv;
    archive.read("names", names_iv);
    std::map<std::string, size_t> saved;
    size_t i = 0;
    for (const auto& n : names_iv.toListRef()) saved[n.toStringRef()] = i++;
    struct Loaded {
      at::Tensor exp_avg, exp_avg_sq;
    };
    std::vector<Loaded> loaded(slots_.size());
    int64_t step = 0;
    for (size_t k = 0; k < slots_.size(); ++k) {
      const Slot& s = slots_[k];
      auto it = saved.find(s.name);
      PT_INPUT_CHECK(it != saved.end(), origin, ": no optimizer state for parameter '", s.name,
                     "' (saved from another model?)");
      torch::serialize::InputArchive one;
      if (!archive.try_read("s" + std::to_string(it->second), one)) continue;  // no step taken yet
      step = std::max(step, read_step(one, s.name, origin));
      c10::IValue amsgrad;
      PT_INPUT_CHECK(!one.try_read("max_exp_avg_sq", amsgrad), origin, ": the optimizer state of '", s.name,
                     "' is AMSGrad's (max_exp_avg_sq), which ", name_, " does not have");
      loaded[k].exp_avg = read_moment(one, "exp_avg", s, origin);
      loaded[k].exp_avg_sq = read_moment(one, "exp_avg_sq", s, origin);
    }
    PT_INPUT_CHECK(saved.size() == slots_.size(), origin, ": optimizer state for ", saved.size(),
                   " parameters, this optimizer has ", slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k) {
      slots_[k].exp_avg = loaded[k].exp_avg;
      slots_[k].exp_avg_sq = loaded[k].exp_avg_sq;
    }
    step_ = step;
  }

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    at::Tensor exp_avg, exp_avg_sq;  // undefined until the first step with a gradient
    float weight_decay;
  };

  // "step" as AdamWParamState writes it (an int); a 0-dim tensor (torch.optim's Python state)
  // is read too.
  static int64_t read_step(torch::serialize::InputArchive& one, const std::string& name, const std::string& origin) {
    c10::IValue v;
    PT_INPUT_CHECK(one.try_read("step", v), origin, ": the optimizer state of '", name, "' has no 'step'");
    int64_t step = -1;
    if (v.isInt()) step = v.toInt();
    else if (v.isDouble()) step = static_cast<int64_t>(v.toDouble());
    else if (v.isTensor() && v.toTensor().numel() == 1) step = static_cast<int64_t>(v.toTensor().item<double>());
    PT_INPUT_CHECK(step >= 0, origin, ": the optimizer state of '", name, "' has an unreadable 'step' (", v.tagKind(),
                   ")");
    return step;
  }

  // A moment of the parameter's shape, copied into memory of our own (fp32, contiguous).
  static at::Tensor read_moment(torch::serialize::InputArchive& one, const char* key, const Slot& s,
                                const std::string& origin) {
    at::Tensor t;
    c10::IValue v;
    PT_INPUT_CHECK(one.try_read(key, v) && v.isTensor(), origin, ": the optimizer state of '", s.name, "' has no '",
                   key, "'");
    t = v.toTensor();
    PT_INPUT_CHECK(t.sizes() == s.param.sizes(), origin, ": optimizer state '", key, "' of '", s.name,
                   "' has shape ", shape_of(t), ", the parameter ", shape_of(s.param));
    PT_INPUT_CHECK(t.is_floating_point(), origin, ": optimizer state '", key, "' of '", s.name, "' is ",
                   t.scalar_type(), ", not a floating-point tensor");
    return at::empty_like(s.param, at::MemoryFormat::Contiguous).copy_(t);
  }

  std::string name_;
  double lr_, beta1_, beta2_, eps_;
  bool adam_w_mode_, bias_correction_;
  int64_t step_ = 0;
  std::vector<Slot> slots_;
  std::unordered_map<const void*, size_t> slot_of_;  ///< parameter -> its slot
};

}  // namespace

std::unique_ptr<Optimizer> make_cpu_adam(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  return std::make_unique<CpuAdam>(cfg, std::move(groups));
}

}  // namespace polytrain
