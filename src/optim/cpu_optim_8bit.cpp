// The 8-bit optimizers' CPU kernels (see cpu_optim_8bit.h). One function per instruction set
// handles a block: dequantize + update + keep the new fp32 moments in a 1 KiB buffer on the
// stack, then requantize from that buffer (the hardware prefetchers follow these sequential
// streams: explicit prefetches of the next blocks changed nothing, measured). The SIMD kernels
// dequantize by the code's formula in registers (a table gather there sat on the update's
// critical path and cost ~40% of the time). The AVX-512 kernel requantizes without a gather
// too (blockwise_quant.h: fast_magnitude; the rare lane within 1/4096 of a step from a midpoint
// sends its vector to the table search), the AVX2 one through a gather from the 12.5 KiB bucket
// table; both give the table's bytes. The last partial vector of a block runs through the same
// vector code on a padded copy, so each element gets the same instruction sequence wherever it
// falls (as in cpu_adam.cpp).
//
// Bit-identical across kernels: every a * b + c that the vector code fuses is an explicit fma
// in the scalar code too (std::fma is exact, hardware or not), nothing else multiplies and adds,
// max is exact, and LAMB's per-block sums of squares use 16 lanes (element j of a block goes to
// lane j % 16) reduced in one fixed tree, in every kernel.
#include "polytrain/optim/cpu_optim_8bit.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "polytrain/common/error.h"
#include "polytrain/optim/blockwise_quant.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain::optim8bit {
namespace {

using quant8::DynamicCode;
using quant8::kBlockSize;

enum class Mode { kAdam, kLambNorms, kLambApply };

/// One step's constants, as floats (from doubles, as cpu_adam computes its own).
struct Consts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size = 0, l2 = 0, decay = 0;                   // Adam: step_size (lr / bc1) sqrt(bc2), eps sqrt(bc2)
  bool use_l2 = false, use_decay = false;                   // Adam
  float weight_decay = 0, neg_scale = 0;                    // LAMB: u's decay term, -(step size * trust)
};

/// What the threads share, read-only.
struct Job {
  Mode mode;
  Consts c;
  float* p;
  const float* g;
  StateView s;
  int64_t n;
  float* block_sums;  ///< LAMB norms pass: [2 b] = sum w^2, [2 b + 1] = sum u^2 of block b
  const DynamicCode* c1;  ///< signed (exp_avg)
  const DynamicCode* c2;  ///< unsigned (exp_avg_sq)
};

int rank(Isa isa) { return static_cast<int>(isa); }

/// The fixed reduction of 16 lane sums: s[i] + s[i + 8], then + 4, + 2, + 1.
float reduce16(const float* s) {
  float r8[8], r4[4], r2[2];
  for (int i = 0; i < 8; ++i) r8[i] = s[i] + s[i + 8];
  for (int i = 0; i < 4; ++i) r4[i] = r8[i] + r8[i + 4];
  for (int i = 0; i < 2; ++i) r2[i] = r4[i] + r4[i + 2];
  return r2[0] + r2[1];
}

// ---- scalar kernel --------------------------------------------------------------------------

void block_scalar(const Job& j, int64_t b) {
  const Consts& c = j.c;
  const int64_t lo = b * kBlockSize, len = std::min(kBlockSize, j.n - lo);
  float* const p = j.p + lo;
  const float* const g = j.g + lo;
  uint8_t* const qm = j.s.exp_avg + lo;
  uint8_t* const qv = j.s.exp_avg_sq + lo;
  const float am = j.s.exp_avg_absmax[b], av = j.s.exp_avg_sq_absmax[b];
  alignas(64) float mb[kBlockSize], vb[kBlockSize];
  float lw[16] = {}, lu[16] = {};
  float mmax = 0.0f, vmax = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    float m = j.c1->values[qm[i]] * am, v = j.c2->values[qv[i]] * av;
    float gi = g[i], pi = p[i];
    if (j.mode == Mode::kAdam) {
      if (c.use_l2) gi = std::fma(pi, c.l2, gi);
      m = std::fma(gi, c.one_minus_beta1, m * c.beta1);
      v = std::fma(gi * gi, c.one_minus_beta2, v * c.beta2);
      if (c.use_decay) pi = std::fma(pi, c.decay, pi);
      p[i] = std::fma(-c.step_size, m / (std::sqrt(v) + c.eps), pi);
    } else {
      m = std::fma(gi, c.one_minus_beta1, m * c.beta1);
      v = std::fma(gi * gi, c.one_minus_beta2, v * c.beta2);
      const float u = std::fma(pi, c.weight_decay, m / (std::sqrt(v) + c.eps));
      if (j.mode == Mode::kLambNorms) {
        lw[i & 15] = std::fma(pi, pi, lw[i & 15]);
        lu[i & 15] = std::fma(u, u, lu[i & 15]);
        continue;
      }
      p[i] = std::fma(c.neg_scale, u, pi);
    }
    mb[i] = m;
    vb[i] = v;
    mmax = std::max(mmax, std::fabs(m));
    vmax = std::max(vmax, v);
  }
  if (j.mode == Mode::kLambNorms) {
    j.block_sums[2 * b] = reduce16(lw);
    j.block_sums[2 * b + 1] = reduce16(lu);
    return;
  }
  const float im = mmax > 0.0f ? 1.0f / mmax : 0.0f, iv = vmax > 0.0f ? 1.0f / vmax : 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    qm[i] = quant8::nearest_index(*j.c1, mb[i] * im);
    qv[i] = quant8::nearest_index(*j.c2, vb[i] * iv);
  }
  j.s.exp_avg_absmax[b] = mmax;
  j.s.exp_avg_sq_absmax[b] = vmax;
}

#if defined(__x86_64__)
#define PT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq")))
#define PT_AVX2 __attribute__((target("avx2,fma,f16c")))

// GCC 12 reports its own _mm512_undefined_*() placeholders inside the intrinsics as "may be
// used uninitialized" when they are inlined into a target("avx512f") function (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// ---- AVX-512 kernel: 16 lanes ---------------------------------------------------------------

struct K512 {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, l2, decay, weight_decay, neg_scale;
};

/// A code's formula constants in registers (blockwise_quant.h: slope[e], first[e], e < 8).
struct Code512 {
  __m512 slope, first;
};

PT_AVX512 inline Code512 code512(const DynamicCode& c) {
  alignas(64) float s[16] = {}, f[16] = {};
  std::memcpy(s, c.slope.data(), sizeof(c.slope));
  std::memcpy(f, c.first.data(), sizeof(c.first));
  return {_mm512_load_ps(s), _mm512_load_ps(f)};
}

/// 16 codes -> values times the block's absmax: the code's formula lane-wise (e from the
/// exponent of float(w), two in-register permutes, one fma), exactly DynamicCode::values.
template <bool Signed>
PT_AVX512 inline __m512 dequant512(const uint8_t* q, const Code512& t, __m512 absmax) {
  const __m512i qi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i d = Signed ? _mm512_sub_epi32(qi, _mm512_set1_epi32(127)) : _mm512_add_epi32(qi, _mm512_set1_epi32(1));
  const __m512 f = _mm512_cvtepi32_ps(Signed ? _mm512_abs_epi32(d) : d);  // w
  const __m512i bits = _mm512_castps_si512(f);
  // e = -1 (the zero code: w = 1 unsigned, w = 0 signed, whose -127 the max lifts) reads the
  // tables' lane 15, slope 0 and first 0: the value 0.
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(Signed ? 127 : 128));
  if (Signed) e = _mm512_max_epi32(e, _mm512_set1_epi32(-1));
  const __m512 k = _mm512_sub_ps(f, _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFF800000u)))));
  __m512i v = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_permutexvar_ps(e, t.slope), k, _mm512_permutexvar_ps(e, t.first)));
  if (Signed)  // negative codes (d < 0, its sign bit set): v | (d & sign bit), exact negation
    v = _mm512_ternarylogic_epi32(v, d, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8);
  return _mm512_mul_ps(_mm512_castsi512_ps(v), absmax);
}

/// quant8::nearest_index on 16 lanes -> 16 bytes. Unsigned: x >= 0 (exp_avg_sq, normalised).
template <bool Signed>
PT_AVX512 inline __m128i nearest512(__m512 x, const DynamicCode& c) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = Signed ? _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)) : bits;
  __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(mag, 16), _mm512_set1_epi32(quant8::kBucketBase));
  b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(quant8::kBuckets - 1));
  const __m512i e = _mm512_i32gather_epi32(b, c.buckets.data(), 4);
  __m512i k = _mm512_srli_epi32(e, 17);
  const __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_and_si512(mag, _mm512_set1_epi32(0xFFFF)),
                                               _mm512_and_si512(e, _mm512_set1_epi32(0x1FFFF)));
  k = _mm512_mask_add_epi32(k, up, k, _mm512_set1_epi32(1));
  if (!Signed) return _mm512_cvtepi32_epi8(k);  // zero_index 0
  const __mmask16 neg = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
  const __m512i zero = _mm512_set1_epi32(c.zero_index);
  const __m512i kneg = _mm512_min_epi32(k, _mm512_set1_epi32(c.max_negative));
  return _mm512_cvtepi32_epi8(_mm512_mask_sub_epi32(_mm512_add_epi32(zero, k), neg, zero, kneg));
}

/// A code's gather-free search tables in registers (DynamicCode::inv_slope ... binade_edge).
struct Fast512 {
  __m512 inv_slope, offset, top, edge_lo, edge_hi;
  __m512i decade_lo, decade_hi;
};

PT_AVX512 inline Fast512 fast512_tables(const DynamicCode& c) {
  return {_mm512_loadu_ps(c.inv_slope.data()),   _mm512_loadu_ps(c.offset.data()),
          _mm512_loadu_ps(c.top.data()),         _mm512_loadu_ps(c.binade_edge.data()),
          _mm512_loadu_ps(c.binade_edge.data() + 16),
          _mm512_loadu_si512(c.binade_decade.data()), _mm512_loadu_si512(c.binade_decade.data() + 16)};
}

/// quant8::fast_magnitude on 16 lanes (no gather: the decade from the binade's two 32-entry
/// tables, the index from the decade's linear formula), then the byte as nearest512. `unsure`
/// gets the lanes within kFastMargin of a midpoint, whose bytes the caller must take from
/// nearest512 instead.
template <bool Signed>
PT_AVX512 inline __m128i fast_nearest512(__m512 x, const Fast512& f, const DynamicCode& c, __mmask16& unsure) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = Signed ? _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)) : bits;
  const __m512 a = _mm512_castsi512_ps(mag);
  // binade: max(exponent - 103, 0) (saturating; the permutes read the low 5 bits)
  const __m512i j = _mm512_subs_epu16(_mm512_srli_epi32(mag, 23), _mm512_set1_epi32(quant8::kBucketBase >> 7));
  __m512i d = _mm512_permutex2var_epi32(f.decade_lo, j, f.decade_hi);
  const __m512 edge = _mm512_permutex2var_ps(f.edge_lo, j, f.edge_hi);
  d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, edge, _CMP_GT_OQ), d, _mm512_set1_epi32(1));
  const __m512 t = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(d, f.inv_slope), _mm512_permutexvar_ps(d, f.offset));
  // t - round(t) (vreduceps) within the margin of 1/2: unsure
  unsure = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT)),
                              _mm512_set1_ps(0.5f - quant8::kFastMargin), _CMP_GT_OQ);
  // Capped at the decade's last index; the conversion rounds to nearest (MXCSR's default), and
  // a lane it could round either way is unsure, so shifting by an integer first changes nothing.
  __m512 k = _mm512_min_ps(t, _mm512_permutexvar_ps(d, f.top));
  if (Signed) {  // zero_index +- k with x's sign, the negative side capped at index 0
    k = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(k), bits,
                                                      _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8));
    k = _mm512_max_ps(_mm512_add_ps(k, _mm512_set1_ps(static_cast<float>(c.zero_index))), _mm512_setzero_ps());
  }
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(k));
}

/// Requantization of one moment: the codes of x[i] * scale for the whole vectors of x[0, len),
/// len <= kBlockSize, by fast_nearest512, with the (rare) unsure vectors redone by nearest512
/// after the loop, so that the loop has no branch. Returns the elements done.
template <bool Signed>
PT_AVX512 inline int64_t requantize512(const float* x, int64_t len, __m512 scale, const Fast512& f,
                                       const DynamicCode& c, uint8_t* q) {
  __mmask16 unsure[kBlockSize / 16];
  __mmask16 any = 0;
  int64_t v = 0;
  for (; (v + 1) * 16 <= len; ++v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + v * 16),
                     fast_nearest512<Signed>(_mm512_mul_ps(_mm512_loadu_ps(x + v * 16), scale), f, c, unsure[v]));
    any = static_cast<__mmask16>(any | unsure[v]);
  }
  if (any != 0)
    for (int64_t u = 0; u < v; ++u)
      if (unsure[u] != 0)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + u * 16),
                         nearest512<Signed>(_mm512_mul_ps(_mm512_loadu_ps(x + u * 16), scale), c));
  return v * 16;
}

/// The fixed 16-lane reduction (reduce16) of one register.
PT_AVX512 inline float reduce512(__m512 s) {
  const __m256 lo = _mm512_castps512_ps256(s);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
  const __m256 r8 = _mm256_add_ps(lo, hi);
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

/// One vector of 16 elements: the update, p written, the fp32 moments into mb / vb, the
/// running maxima or (norms pass) the lane sums; `valid` masks a padded tail out of the sums.
PT_AVX512 inline void chunk512(const Job& j, const K512& k, const Code512& c1, const Code512& c2, __m512 am,
                               __m512 av, float* pp, const float* gp, const uint8_t* qm, const uint8_t* qv, float* mb,
                               float* vb, __m512& mmax, __m512& vmax, __m512& lw, __m512& lu, __mmask16 valid) {
  __m512 m = dequant512<true>(qm, c1, am);
  __m512 v = dequant512<false>(qv, c2, av);
  __m512 g = _mm512_loadu_ps(gp);
  __m512 p = _mm512_loadu_ps(pp);
  if (j.mode == Mode::kAdam) {
    if (j.c.use_l2) g = _mm512_fmadd_ps(p, k.l2, g);
    m = _mm512_fmadd_ps(g, k.one_minus_beta1, _mm512_mul_ps(m, k.beta1));
    v = _mm512_fmadd_ps(_mm512_mul_ps(g, g), k.one_minus_beta2, _mm512_mul_ps(v, k.beta2));
    if (j.c.use_decay) p = _mm512_fmadd_ps(p, k.decay, p);
    const __m512 ratio = _mm512_div_ps(m, _mm512_add_ps(_mm512_sqrt_ps(v), k.eps));
    _mm512_storeu_ps(pp, _mm512_fnmadd_ps(k.step_size, ratio, p));
  } else {
    m = _mm512_fmadd_ps(g, k.one_minus_beta1, _mm512_mul_ps(m, k.beta1));
    v = _mm512_fmadd_ps(_mm512_mul_ps(g, g), k.one_minus_beta2, _mm512_mul_ps(v, k.beta2));
    const __m512 u = _mm512_fmadd_ps(p, k.weight_decay, _mm512_div_ps(m, _mm512_add_ps(_mm512_sqrt_ps(v), k.eps)));
    if (j.mode == Mode::kLambNorms) {
      lw = _mm512_mask3_fmadd_ps(p, p, lw, valid);  // lanes off `valid` (a padded tail) keep lw
      lu = _mm512_mask3_fmadd_ps(u, u, lu, valid);
      return;
    }
    _mm512_storeu_ps(pp, _mm512_fmadd_ps(k.neg_scale, u, p));
  }
  _mm512_storeu_ps(mb, m);
  _mm512_storeu_ps(vb, v);
  mmax = _mm512_range_ps(mmax, m, 0x0B);  // the larger magnitude, sign cleared
  vmax = _mm512_max_ps(vmax, v);
}

PT_AVX512 void block_avx512(const Job& j, int64_t b) {
  const Consts& c = j.c;
  const K512 k{_mm512_set1_ps(c.beta1),  _mm512_set1_ps(c.one_minus_beta1), _mm512_set1_ps(c.beta2),
               _mm512_set1_ps(c.one_minus_beta2), _mm512_set1_ps(c.eps), _mm512_set1_ps(c.step_size),
               _mm512_set1_ps(c.l2), _mm512_set1_ps(c.decay), _mm512_set1_ps(c.weight_decay),
               _mm512_set1_ps(c.neg_scale)};
  const int64_t lo = b * kBlockSize, len = std::min(kBlockSize, j.n - lo);
  float* const p = j.p + lo;
  const float* const g = j.g + lo;
  uint8_t* const qm = j.s.exp_avg + lo;
  uint8_t* const qv = j.s.exp_avg_sq + lo;
  const __m512 am = _mm512_set1_ps(j.s.exp_avg_absmax[b]), av = _mm512_set1_ps(j.s.exp_avg_sq_absmax[b]);
  alignas(64) float mb[kBlockSize], vb[kBlockSize];
  __m512 mmax = _mm512_setzero_ps(), vmax = _mm512_setzero_ps(), lw = _mm512_setzero_ps(), lu = _mm512_setzero_ps();
  const Code512 c1 = code512(*j.c1), c2 = code512(*j.c2);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    chunk512(j, k, c1, c2, am, av, p + i, g + i, qm + i, qv + i, mb + i, vb + i, mmax, vmax, lw, lu, 0xFFFF);
  const int64_t r = len - i;
  if (r > 0) {  // the tail: zero weights and gradients, codes of 0 (so zero moments) past it
    alignas(64) float tp[16] = {}, tg[16] = {};
    alignas(16) uint8_t tm[16], tv[16];
    std::memset(tm, j.c1->zero_index, 16);
    std::memset(tv, j.c2->zero_index, 16);
    std::memcpy(tp, p + i, static_cast<size_t>(r) * 4);
    std::memcpy(tg, g + i, static_cast<size_t>(r) * 4);
    std::memcpy(tm, qm + i, static_cast<size_t>(r));
    std::memcpy(tv, qv + i, static_cast<size_t>(r));
    chunk512(j, k, c1, c2, am, av, tp, tg, tm, tv, mb + i, vb + i, mmax, vmax, lw, lu,
             static_cast<__mmask16>((1u << r) - 1));
    if (j.mode != Mode::kLambNorms) std::memcpy(p + i, tp, static_cast<size_t>(r) * 4);
  }
  if (j.mode == Mode::kLambNorms) {
    j.block_sums[2 * b] = reduce512(lw);
    j.block_sums[2 * b + 1] = reduce512(lu);
    return;
  }
  const float mx = _mm512_reduce_max_ps(mmax), vx = _mm512_reduce_max_ps(vmax);
  const __m512 im = _mm512_set1_ps(mx > 0.0f ? 1.0f / mx : 0.0f), iv = _mm512_set1_ps(vx > 0.0f ? 1.0f / vx : 0.0f);
  const Fast512 f1 = fast512_tables(*j.c1), f2 = fast512_tables(*j.c2);
  requantize512<true>(mb, len, im, f1, *j.c1, qm);
  i = requantize512<false>(vb, len, iv, f2, *j.c2, qv);
  if (r > 0) {  // mb / vb hold the padded vector's 16 values
    alignas(16) uint8_t tm[16], tv[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(tm), nearest512<true>(_mm512_mul_ps(_mm512_loadu_ps(mb + i), im), *j.c1));
    _mm_store_si128(reinterpret_cast<__m128i*>(tv), nearest512<false>(_mm512_mul_ps(_mm512_loadu_ps(vb + i), iv), *j.c2));
    std::memcpy(qm + i, tm, static_cast<size_t>(r));
    std::memcpy(qv + i, tv, static_cast<size_t>(r));
  }
  j.s.exp_avg_absmax[b] = mx;
  j.s.exp_avg_sq_absmax[b] = vx;
}

// ---- AVX2 + FMA kernel: 8 lanes, two registers for the 16 lanes of a chunk -------------------

struct K256 {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, l2, decay, weight_decay, neg_scale;
};

struct Code256 {
  __m256 slope, first;
};

PT_AVX2 inline Code256 code256(const DynamicCode& c) {
  return {_mm256_loadu_ps(c.slope.data()), _mm256_loadu_ps(c.first.data())};
}

/// dequant512 on 8 lanes.
template <bool Signed>
PT_AVX2 inline __m256 dequant256(const uint8_t* q, const Code256& t, __m256 absmax) {
  const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i d = Signed ? _mm256_sub_epi32(qi, _mm256_set1_epi32(127)) : _mm256_add_epi32(qi, _mm256_set1_epi32(1));
  const __m256 f = _mm256_cvtepi32_ps(Signed ? _mm256_abs_epi32(d) : d);
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(Signed ? 127 : 128));
  const __m256 k = _mm256_sub_ps(f, _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFF800000u)))));
  const __m256 mag = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(t.slope, e), k, _mm256_permutevar8x32_ps(t.first, e));
  __m256i v = _mm256_and_si256(_mm256_castps_si256(mag), _mm256_cmpgt_epi32(e, _mm256_set1_epi32(-1)));
  if (Signed)
    v = _mm256_or_si256(v, _mm256_and_si256(_mm256_srai_epi32(d, 31), _mm256_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm256_mul_ps(_mm256_castsi256_ps(v), absmax);
}

/// quant8::nearest_index on 8 lanes -> 8 indices as int32. Unsigned: x >= 0.
template <bool Signed>
PT_AVX2 inline __m256i nearest256(__m256 x, const DynamicCode& c) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i mag = Signed ? _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)) : bits;
  __m256i b = _mm256_sub_epi32(_mm256_srli_epi32(mag, 16), _mm256_set1_epi32(quant8::kBucketBase));
  b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(quant8::kBuckets - 1));
  const __m256i e = _mm256_i32gather_epi32(c.buckets.data(), b, 4);
  const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(0xFFFF)),
                                        _mm256_and_si256(e, _mm256_set1_epi32(0x1FFFF)));
  const __m256i k = _mm256_sub_epi32(_mm256_srli_epi32(e, 17), up);  // up is -1 where true
  if (!Signed) return k;  // zero_index 0
  const __m256i zero = _mm256_set1_epi32(c.zero_index);
  const __m256i kneg = _mm256_min_epi32(k, _mm256_set1_epi32(c.max_negative));
  const __m256i neg = _mm256_srai_epi32(bits, 31);
  return _mm256_blendv_epi8(_mm256_add_epi32(zero, k), _mm256_sub_epi32(zero, kneg), neg);
}

/// Two vectors of 8 indices (0..255) -> 16 bytes, in order.
PT_AVX2 inline __m128i pack16(__m256i a, __m256i b) {
  // packus works per 128-bit half: [a0-3 b0-3 | a4-7 b4-7]; reorder the 64-bit words to a, b.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/// 16 values times `scale` -> their 16 code bytes (two halves of 8 through nearest256).
template <bool Signed>
PT_AVX2 inline __m128i codes16_avx2(const float* x, __m256 scale, const DynamicCode& c) {
  return pack16(nearest256<Signed>(_mm256_mul_ps(_mm256_loadu_ps(x), scale), c),
                nearest256<Signed>(_mm256_mul_ps(_mm256_loadu_ps(x + 8), scale), c));
}

PT_AVX2 inline float reduce256x2(__m256 a, __m256 b) {
  const __m256 r8 = _mm256_add_ps(a, b);
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

PT_AVX2 inline __m256 abs256(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/// Half a chunk (8 elements, lanes `half * 8` ..): as chunk512.
PT_AVX2 inline void half256(const Job& j, const K256& k, const Code256& c1, const Code256& c2, __m256 am, __m256 av,
                            float* pp, const float* gp, const uint8_t* qm, const uint8_t* qv, float* mb, float* vb,
                            __m256& mmax, __m256& vmax, __m256& lw, __m256& lu, __m256 valid) {
  __m256 m = dequant256<true>(qm, c1, am);
  __m256 v = dequant256<false>(qv, c2, av);
  __m256 g = _mm256_loadu_ps(gp);
  __m256 p = _mm256_loadu_ps(pp);
  if (j.mode == Mode::kAdam) {
    if (j.c.use_l2) g = _mm256_fmadd_ps(p, k.l2, g);
    m = _mm256_fmadd_ps(g, k.one_minus_beta1, _mm256_mul_ps(m, k.beta1));
    v = _mm256_fmadd_ps(_mm256_mul_ps(g, g), k.one_minus_beta2, _mm256_mul_ps(v, k.beta2));
    if (j.c.use_decay) p = _mm256_fmadd_ps(p, k.decay, p);
    const __m256 ratio = _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), k.eps));
    _mm256_storeu_ps(pp, _mm256_fnmadd_ps(k.step_size, ratio, p));
  } else {
    m = _mm256_fmadd_ps(g, k.one_minus_beta1, _mm256_mul_ps(m, k.beta1));
    v = _mm256_fmadd_ps(_mm256_mul_ps(g, g), k.one_minus_beta2, _mm256_mul_ps(v, k.beta2));
    const __m256 u = _mm256_fmadd_ps(p, k.weight_decay, _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), k.eps)));
    if (j.mode == Mode::kLambNorms) {
      lw = _mm256_blendv_ps(lw, _mm256_fmadd_ps(p, p, lw), valid);
      lu = _mm256_blendv_ps(lu, _mm256_fmadd_ps(u, u, lu), valid);
      return;
    }
    _mm256_storeu_ps(pp, _mm256_fmadd_ps(k.neg_scale, u, p));
  }
  _mm256_storeu_ps(mb, m);
  _mm256_storeu_ps(vb, v);
  mmax = _mm256_max_ps(mmax, abs256(m));
  vmax = _mm256_max_ps(vmax, v);
}

PT_AVX2 void block_avx2(const Job& j, int64_t b) {
  const Consts& c = j.c;
  const K256 k{_mm256_set1_ps(c.beta1),  _mm256_set1_ps(c.one_minus_beta1), _mm256_set1_ps(c.beta2),
               _mm256_set1_ps(c.one_minus_beta2), _mm256_set1_ps(c.eps), _mm256_set1_ps(c.step_size),
               _mm256_set1_ps(c.l2), _mm256_set1_ps(c.decay), _mm256_set1_ps(c.weight_decay),
               _mm256_set1_ps(c.neg_scale)};
  const int64_t lo = b * kBlockSize, len = std::min(kBlockSize, j.n - lo);
  float* const p = j.p + lo;
  const float* const g = j.g + lo;
  uint8_t* const qm = j.s.exp_avg + lo;
  uint8_t* const qv = j.s.exp_avg_sq + lo;
  const __m256 am = _mm256_set1_ps(j.s.exp_avg_absmax[b]), av = _mm256_set1_ps(j.s.exp_avg_sq_absmax[b]);
  alignas(64) float mb[kBlockSize], vb[kBlockSize];
  __m256 mmax = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
  __m256 lw0 = _mm256_setzero_ps(), lw1 = _mm256_setzero_ps(), lu0 = _mm256_setzero_ps(), lu1 = _mm256_setzero_ps();
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const Code256 c1 = code256(*j.c1), c2 = code256(*j.c2);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    half256(j, k, c1, c2, am, av, p + i, g + i, qm + i, qv + i, mb + i, vb + i, mmax, vmax, lw0, lu0, all);
    half256(j, k, c1, c2, am, av, p + i + 8, g + i + 8, qm + i + 8, qv + i + 8, mb + i + 8, vb + i + 8, mmax, vmax,
            lw1, lu1, all);
  }
  const int64_t r = len - i;
  if (r > 0) {
    alignas(64) float tp[16] = {}, tg[16] = {};
    alignas(16) uint8_t tm[16], tv[16];
    std::memset(tm, j.c1->zero_index, 16);
    std::memset(tv, j.c2->zero_index, 16);
    std::memcpy(tp, p + i, static_cast<size_t>(r) * 4);
    std::memcpy(tg, g + i, static_cast<size_t>(r) * 4);
    std::memcpy(tm, qm + i, static_cast<size_t>(r));
    std::memcpy(tv, qv + i, static_cast<size_t>(r));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)), lane));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r) - 8), lane));
    half256(j, k, c1, c2, am, av, tp, tg, tm, tv, mb + i, vb + i, mmax, vmax, lw0, lu0, valid0);
    half256(j, k, c1, c2, am, av, tp + 8, tg + 8, tm + 8, tv + 8, mb + i + 8, vb + i + 8, mmax, vmax, lw1, lu1,
            valid1);
    if (j.mode != Mode::kLambNorms) std::memcpy(p + i, tp, static_cast<size_t>(r) * 4);
  }
  if (j.mode == Mode::kLambNorms) {
    j.block_sums[2 * b] = reduce256x2(lw0, lw1);
    j.block_sums[2 * b + 1] = reduce256x2(lu0, lu1);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mmax);
  const float mx = *std::max_element(lanes, lanes + 8);
  _mm256_store_ps(lanes, vmax);
  const float vx = *std::max_element(lanes, lanes + 8);
  const __m256 im = _mm256_set1_ps(mx > 0.0f ? 1.0f / mx : 0.0f), iv = _mm256_set1_ps(vx > 0.0f ? 1.0f / vx : 0.0f);
  auto quantize16 = [&](int64_t at, uint8_t* dm, uint8_t* dv) PT_AVX2 {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dm), codes16_avx2<true>(mb + at, im, *j.c1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dv), codes16_avx2<false>(vb + at, iv, *j.c2));
  };
  for (i = 0; i + 16 <= len; i += 16) quantize16(i, qm + i, qv + i);
  if (r > 0) {
    alignas(16) uint8_t tm[16], tv[16];
    quantize16(i, tm, tv);
    std::memcpy(qm + i, tm, static_cast<size_t>(r));
    std::memcpy(qv + i, tv, static_cast<size_t>(r));
  }
  j.s.exp_avg_absmax[b] = mx;
  j.s.exp_avg_sq_absmax[b] = vx;
}

/// nearest_codes' vector part: whole vectors of 16, in blocks as the kernel; returns how many values it did.
PT_AVX512 int64_t nearest_codes_avx512(const DynamicCode& c, const float* x, int64_t n, uint8_t* out) {
  const Fast512 f = fast512_tables(c);
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += kBlockSize) {
    const int64_t len = std::min(kBlockSize, n - i);
    const int64_t done = c.is_signed ? requantize512<true>(x + i, len, one, f, c, out + i)
                                     : requantize512<false>(x + i, len, one, f, c, out + i);
    if (done < len) return i + done;
  }
  return std::min(i, n);
}

PT_AVX2 int64_t nearest_codes_avx2(const DynamicCode& c, const float* x, int64_t n, uint8_t* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     c.is_signed ? codes16_avx2<true>(x + i, one, c) : codes16_avx2<false>(x + i, one, c));
  return i;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // __x86_64__

// ---- dispatch and threads ----------------------------------------------------------------------

struct Run {
  const Job* job;
  Isa isa;
};

void run_blocks(const void* ctx, int64_t begin, int64_t end) {
  const Run& r = *static_cast<const Run*>(ctx);
  for (int64_t b = begin; b < end; ++b) {
#if defined(__x86_64__)
    if (r.isa == Isa::kAvx512) {
      block_avx512(*r.job, b);
      continue;
    }
    if (r.isa == Isa::kAvx2) {
      block_avx2(*r.job, b);
      continue;
    }
#endif
    block_scalar(*r.job, b);
  }
}

constexpr int64_t kGrainBlocks = 32768 / kBlockSize;  // at least 32K elements a thread, as cpu_adam

void run(const Job& job, Isa isa) {
  const int64_t blocks = quant8::num_blocks(job.n);
  const Run r{&job, isa};
  cpu_pool::run(&run_blocks, &r, blocks, cpu_pool::parts_for(blocks, kGrainBlocks));
}

void check_call(int64_t n, const float* param, const float* grad, const StateView& s, Isa isa, const char* what) {
  PT_CHECK(n >= 0, what, " over ", n, " elements");
  PT_CHECK(param != nullptr && grad != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr &&
           s.exp_avg_absmax != nullptr && s.exp_avg_sq_absmax != nullptr);
  PT_CHECK(rank(isa) <= rank(cpu_adam::hardware_isa()), what, ": the ", cpu_adam::isa_name(isa),
           " kernel needs instructions this CPU (or OS) lacks; best available: ",
           cpu_adam::isa_name(cpu_adam::hardware_isa()));
}

Consts moments_consts(double beta1, double beta2, double eps) {
  Consts c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  return c;
}

}  // namespace

void adam_step(const cpu_adam::Hyper& h, int64_t step, float* param, const float* grad, const StateView& state,
               int64_t n, Isa isa) {
  check_call(n, param, grad, state, isa, "optim8bit::adam_step");
  if (n == 0) return;
  PT_CHECK(step >= 1 || !h.bias_correction, "optim8bit::adam_step: step count ", step, " (1-based)");
  // As cpu_adam's constants: the corrections in double, then cast to float.
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, wd = h.weight_decay;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  // m / (sqrt(v) / sqrt(bc2) + eps) = sqrt(bc2) m / (sqrt(v) + eps sqrt(bc2)): one division.
  Consts c = moments_consts(b1, b2, static_cast<double>(h.eps) * std::sqrt(bc2));
  c.step_size = static_cast<float>(lr / bc1 * std::sqrt(bc2));
  c.l2 = h.weight_decay;
  c.decay = static_cast<float>(-lr * wd);
  c.use_l2 = h.weight_decay > 0 && !h.adam_w_mode;
  c.use_decay = h.weight_decay > 0 && h.adam_w_mode;
  const Job job{Mode::kAdam, c, param, grad, state, n, nullptr, &quant8::signed_code(), &quant8::unsigned_code()};
  run(job, isa);
}

double lamb_step(const LambHyper& h, int64_t step, float* param, const float* grad, const StateView& state,
                 int64_t n, float* scratch, Isa isa) {
  check_call(n, param, grad, state, isa, "optim8bit::lamb_step");
  PT_CHECK(scratch != nullptr && step >= 1);
  if (n == 0) return 1.0;
  Consts c = moments_consts(h.beta1, h.beta2, h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
  Job job{Mode::kLambNorms, c, param, grad, state, n, scratch, &quant8::signed_code(), &quant8::unsigned_code()};
  run(job, isa);
  double w2 = 0, u2 = 0;  // over blocks in block order: the same sum whatever the threads
  for (int64_t b = 0; b < quant8::num_blocks(n); ++b) {
    w2 += scratch[2 * b];
    u2 += scratch[2 * b + 1];
  }
  const double weight_norm = std::min(std::sqrt(w2), h.clamp_value);
  const double update_norm = std::sqrt(u2);
  const double trust = weight_norm == 0.0 || update_norm == 0.0 ? 1.0 : weight_norm / update_norm;
  double step_size = h.lr;
  if (h.debias) {
    const double t = static_cast<double>(step);
    step_size *= std::sqrt(1.0 - std::pow(h.beta2, t)) / (1.0 - std::pow(h.beta1, t));
  }
  job.mode = Mode::kLambApply;
  job.c.neg_scale = static_cast<float>(-step_size * trust);
  run(job, isa);
  return trust;
}

void nearest_codes(const DynamicCode& code, const float* x, int64_t n, uint8_t* out, Isa isa) {
  PT_CHECK(n >= 0 && rank(isa) <= rank(cpu_adam::hardware_isa()), "optim8bit::nearest_codes: ", n, " values, ",
           cpu_adam::isa_name(isa), " kernel");
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) i = nearest_codes_avx512(code, x, n, out);
  if (isa == Isa::kAvx2) i = nearest_codes_avx2(code, x, n, out);
#endif
  for (; i < n; ++i) out[i] = quant8::nearest_index(code, x[i]);
}

}  // namespace polytrain::optim8bit
