// polytrain's CPU vector code (internal to src/ops): 16 fp32 lanes in GCC's vector extensions,
// loads and stores of fp32 and bf16, e^x, and the run-time choice between the AVX-512, AVX2 + FMA
// and generic builds of a kernel body. Shared by the fused operations of cpu_ops.cpp and the
// attention of cpu_attention.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// The 16-lane vector type below is passed only between always-inline functions.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace polytrain::cpu_ops::vec {

// 16 fp32 lanes in GCC's vector extensions: one AVX-512 register, two AVX2 ones, four SSE ones.
// Every kernel works on whole vectors (a row's or tensor's tail through a padded copy), so an
// element's result does not depend on where it sits, nor on the vector unit beyond FMA
// contraction (the AVX2 and AVX-512 variants both contract).
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

#define PT_VEC __attribute__((always_inline)) inline

PT_VEC vf splat(float a) { return vf{} + a; }

PT_VEC vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
PT_VEC vf load(const uint16_t* p) {  // bf16: the high half of an fp32
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
// a > b ? x : y lane by lane, for a body built for vector unit Isa (2: AVX-512, 1: AVX2 + FMA,
// 0: generic). GCC 12 lowers a condition on 16-lane vectors into 16 scalar compares and blends
// when the target has no 512-bit registers (a softmax row ran 8x slower on the AVX2 build than
// on the AVX-512 one): there it runs on two 8-lane halves, which AVX2 has; the AVX-512 build keeps
// one 16-lane compare (halves there ran 3x slower). The same lanes either way: the same bits.
template <int Isa, typename C, typename V>
PT_VEC V select_gt(C a, C b, V x, V y) {
  if constexpr (Isa == 2) {
    return a > b ? x : y;
  } else {
    typedef typename std::remove_reference<decltype(a[0])>::type CE;
    typedef typename std::remove_reference<decltype(x[0])>::type VE;
    typedef CE C8 __attribute__((vector_size(32)));
    typedef VE V8 __attribute__((vector_size(32)));
    C8 a2[2], b2[2];
    V8 x2[2], y2[2], r2[2];
    std::memcpy(a2, &a, sizeof a), std::memcpy(b2, &b, sizeof b);
    std::memcpy(x2, &x, sizeof x), std::memcpy(y2, &y, sizeof y);
    r2[0] = a2[0] > b2[0] ? x2[0] : y2[0];
    r2[1] = a2[1] > b2[1] ? x2[1] : y2[1];
    V r;
    std::memcpy(&r, r2, sizeof r);
    return r;
  }
}

template <int Isa = 2>  // fp32 stores are the same on every unit: store(p, v) will do
PT_VEC void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
template <int Isa>
PT_VEC void store(uint16_t* p, vf v) {  // round to nearest even, NaN kept NaN (c10::BFloat16's rule)
  const vu u = (vu)(v);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = select_gt<Isa>(u & 0x7fffffffu, vu{} + 0x7f800000u, vu{} + 0x7fc0u, r);  // NaN: |bits| above inf's
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
}

// e^x to ~1 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n by exponent
// bits); 0 below -87.33 (no subnormals, and -inf -> 0 exactly), inf above 88.37, NaN kept.
template <int Isa>
PT_VEC vf vexp(vf x) {
  const float hi = 88.3762626647949f, lo = -87.3365447505531f;
  vf c = select_gt<Isa>(x, splat(hi), splat(hi), x);
  c = select_gt<Isa>(splat(lo), c, splat(lo), c);
  const vf n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf y = p * (vf)(e);
  y = select_gt<Isa>(splat(lo), x, splat(0.0f), y);
  return select_gt<Isa>(x, splat(hi), splat(std::numeric_limits<float>::infinity()), y);
}

#if defined(__x86_64__)
#define PT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define PT_AVX2 __attribute__((target("avx2,fma")))
inline std::atomic<int> forced_level{-1};  // set_vector_level for the tests
inline int vector_level() {  // 2: AVX-512, 1: AVX2 + FMA, 0: the generic build
  static const int level = __builtin_cpu_supports("avx512f")                                 ? 2
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                             : 0;
  const int forced = forced_level.load(std::memory_order_relaxed);
  return forced >= 0 && forced < level ? forced : level;
}
#else
#define PT_AVX512
#define PT_AVX2
inline std::atomic<int> forced_level{-1};
inline int vector_level() { return 0; }
#endif

// Body::run<Isa>(job, begin, end), always inline, built for each of the three (Isa 2, 1, 0) and
// chosen at run time.
template <typename Body, typename Job>
PT_AVX512 void on_avx512(const Job& j, int64_t b, int64_t e) {
  Body::template run<2>(j, b, e);
}
template <typename Body, typename Job>
PT_AVX2 void on_avx2(const Job& j, int64_t b, int64_t e) {
  Body::template run<1>(j, b, e);
}
template <typename Body, typename Job>
void on_generic(const Job& j, int64_t b, int64_t e) {
  Body::template run<0>(j, b, e);
}
template <typename Body, typename Job>
void dispatch(const Job& j, int64_t b, int64_t e) {
  const int level = vector_level();
  if (level == 2) on_avx512<Body>(j, b, e);
  else if (level == 1) on_avx2<Body>(j, b, e);
  else on_generic<Body>(j, b, e);
}

// max(m, v) lane by lane; a NaN in v is not taken (it reaches the result through what the
// caller computes from v next, e^(v - max) in every softmax here). One comparison: GCC 12
// turns a condition of two OR-ed comparisons, (v > m) | (v != v), into 16 scalar compares
// (a softmax row ran 5x slower with it).
template <int Isa>
PT_VEC vf running_max(vf m, vf v) {
  return select_gt<Isa>(v, m, v, m);
}

PT_VEC float lanes_max(vf v) {
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = v[k] > m || v[k] != v[k] ? v[k] : m;
  return m;
}
PT_VEC float lanes_sum(vf v) {
  float s = 0.0f;
  for (int k = 0; k < kLanes; ++k) s += v[k];
  return s;
}

// The row's tail (cols % 16 entries) as a whole vector, padded with -inf (probability 0).
template <typename T>
PT_VEC vf load_tail(const T* p, int64_t r) {
  T buf[kLanes];
  if constexpr (std::is_same_v<T, float>) std::fill(buf, buf + kLanes, -std::numeric_limits<float>::infinity());
  else std::fill(buf, buf + kLanes, uint16_t{0xff80});  // bf16 -inf
  std::memcpy(buf, p, r * sizeof(T));
  return load(buf);
}

template <typename T>
PT_VEC float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace polytrain::cpu_ops::vec
