#include "polytrain/ops/cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/optim/worker_pool.h"

// The 16-lane vector type below is passed only between always-inline functions.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace polytrain::cpu_ops {
namespace {

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
PT_VEC void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
PT_VEC void store(uint16_t* p, vf v) {  // round to nearest even, NaN kept NaN (c10::BFloat16's rule)
  const vu u = (vu)(v);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = v != v ? vu{} + 0x7fc0u : r;
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
}

// e^x to ~1 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n by exponent
// bits); 0 below -87.33 (no subnormals, and -inf -> 0 exactly), inf above 88.37, NaN kept.
PT_VEC vf vexp(vf x) {
  const float hi = 88.3762626647949f, lo = -87.3365447505531f;
  vf c = x > hi ? splat(hi) : x;
  c = c < lo ? splat(lo) : c;
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
  y = x < lo ? splat(0.0f) : y;
  return x > hi ? splat(std::numeric_limits<float>::infinity()) : y;
}

constexpr float kSqrt2OverPi = 0.7978845608028654f, kTanhCubic = 0.044715f;

// GELU's tanh form through q = 1 - tanh(u) = 2 / (E + 1), E = e^2u, which has no
// cancellation: 1 + tanh(u) = E q (u < 0) or 2 - q (u >= 0), and 1 - tanh(u)^2 = q (1 + tanh(u)).
struct TanhParts {
  vf q, one_plus;
};
PT_VEC TanhParts tanh_parts(vf x) {
  const vf e = vexp(2.0f * (kSqrt2OverPi * (x + kTanhCubic * x * x * x)));
  const vf q = 2.0f / (e + 1.0f);
  return {q, x < 0.0f ? e * q : 2.0f - q};
}

PT_VEC vf gelu_fwd(vf x) { return 0.5f * x * tanh_parts(x).one_plus; }

PT_VEC vf gelu_grad(vf x) {  // d gelu / dx
  const TanhParts t = tanh_parts(x);
  return 0.5f * t.one_plus + 0.5f * x * t.q * t.one_plus * kSqrt2OverPi * (1.0f + 3.0f * kTanhCubic * x * x);
}

#if defined(__x86_64__)
#define PT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define PT_AVX2 __attribute__((target("avx2,fma")))
std::atomic<int> forced_level{-1};  // set_vector_level for the tests
int vector_level() {  // 2: AVX-512, 1: AVX2 + FMA, 0: the generic build
  static const int level = __builtin_cpu_supports("avx512f")                                 ? 2
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                             : 0;
  const int forced = forced_level.load(std::memory_order_relaxed);
  return forced >= 0 && forced < level ? forced : level;
}
#else
#define PT_AVX512
#define PT_AVX2
std::atomic<int> forced_level{-1};
int vector_level() { return 0; }
#endif

// Body::run(job, begin, end), always inline, built for each of the three and chosen at run time.
template <typename Body, typename Job>
PT_AVX512 void on_avx512(const Job& j, int64_t b, int64_t e) {
  Body::run(j, b, e);
}
template <typename Body, typename Job>
PT_AVX2 void on_avx2(const Job& j, int64_t b, int64_t e) {
  Body::run(j, b, e);
}
template <typename Body, typename Job>
void on_generic(const Job& j, int64_t b, int64_t e) {
  Body::run(j, b, e);
}
template <typename Body, typename Job>
void dispatch(const Job& j, int64_t b, int64_t e) {
  const int level = vector_level();
  if (level == 2) on_avx512<Body>(j, b, e);
  else if (level == 1) on_avx2<Body>(j, b, e);
  else on_generic<Body>(j, b, e);
}

// ---- GELU -----------------------------------------------------------------------------------

struct GeluJob {
  const void* x;
  const void* g;  // backward: the incoming gradient; null in forward
  void* out;
  int64_t n;
};

template <typename T>
PT_VEC void gelu_vectors(const GeluJob& j, int64_t v0, int64_t v1) {
  const T* x = static_cast<const T*>(j.x) + v0 * kLanes;
  const T* g = j.g ? static_cast<const T*>(j.g) + v0 * kLanes : nullptr;
  T* out = static_cast<T*>(j.out) + v0 * kLanes;
  for (int64_t v = v0; v < v1; ++v, x += kLanes, out += kLanes) {
    if (g) {
      store(out, load(g) * gelu_grad(load(x)));
      g += kLanes;
    } else {
      store(out, gelu_fwd(load(x)));
    }
  }
}

template <typename T>
struct GeluBody {
  static PT_VEC void run(const GeluJob& j, int64_t v0, int64_t v1) { gelu_vectors<T>(j, v0, v1); }
};

template <typename T>
void run_gelu(const void* ctx, int64_t v0, int64_t v1) {
  const GeluJob& j = *static_cast<const GeluJob*>(ctx);
  const int64_t whole = j.n / kLanes;
  if (v0 < std::min(v1, whole)) dispatch<GeluBody<T>>(j, v0, std::min(v1, whole));
  if (v1 > whole) {  // the tail, through the same vector code on zero-padded copies
    const int64_t r = j.n - whole * kLanes;
    T x[kLanes] = {}, g[kLanes] = {}, out[kLanes] = {};
    std::memcpy(x, static_cast<const T*>(j.x) + whole * kLanes, r * sizeof(T));
    if (j.g) std::memcpy(g, static_cast<const T*>(j.g) + whole * kLanes, r * sizeof(T));
    const GeluJob tail{x, j.g ? g : nullptr, out, kLanes};
    // The body's build too (AVX-512 / AVX2 with FMA): the generic build rounds some inputs
    // differently, and an element's bits would depend on whether it falls in the tail.
    dispatch<GeluBody<T>>(tail, 0, 1);
    std::memcpy(static_cast<T*>(j.out) + whole * kLanes, out, r * sizeof(T));
  }
}

at::Tensor gelu_kernel(const at::Tensor& x, const at::Tensor& grad) {
  const auto xc = x.contiguous();
  const auto gc = grad.defined() ? grad.to(xc.scalar_type()).contiguous() : grad;
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  const GeluJob job{xc.data_ptr(), gc.defined() ? gc.data_ptr() : nullptr, out.data_ptr(), xc.numel()};
  const int64_t units = (job.n + kLanes - 1) / kLanes;
  const int parts = cpu_pool::parts_for(units, 4096);
  if (xc.scalar_type() == at::kFloat) cpu_pool::run(run_gelu<float>, &job, units, parts);
  else cpu_pool::run(run_gelu<uint16_t>, &job, units, parts);
  return out;
}

struct GeluFn : torch::autograd::Function<GeluFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return gelu_kernel(x, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    return {gelu_kernel(x, grads[0])};
  }
};

// ---- cross-entropy chain ----------------------------------------------------------------------

struct XentJob {
  void* logits;
  int64_t cols, ld;
  const int64_t* labels;
  const float* weight;
  float* row_loss;
  bool grad;
};

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

// Rows [r0, r1): max (one read), sum of exponentials (one read, from cache: a GPT-2 row is
// 100-200 KB), then the gradient (exponentials again, one write).
template <typename T>
PT_VEC void xent_rows(const XentJob& j, int64_t r0, int64_t r1) {
  const int64_t cols = j.cols, whole = cols / kLanes * kLanes, tail = cols - whole;
  for (int64_t r = r0; r < r1; ++r) {
    T* x = static_cast<T*>(j.logits) + r * j.ld;
    vf m = splat(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < whole; c += kLanes) {
      const vf v = load(x + c);
      m = (v > m) | (v != v) ? v : m;
    }
    if (tail) {
      const vf v = load_tail(x + whole, tail);
      m = (v > m) | (v != v) ? v : m;
    }
    const float mx = lanes_max(m);
    vf s = splat(0.0f);
    for (int64_t c = 0; c < whole; c += kLanes) s += vexp(load(x + c) - mx);
    if (tail) s += vexp(load_tail(x + whole, tail) - mx);
    const float sum = lanes_sum(s), w = j.weight[r];
    const int64_t y = j.labels[r];
    const float xy = to_float(x[y]);
    j.row_loss[r] = w * (mx + std::log(sum) - xy);
    if (!j.grad) continue;
    const float scale = w / sum;
    for (int64_t c = 0; c < whole; c += kLanes) store(x + c, vexp(load(x + c) - mx) * scale);
    if (tail) {
      T out[kLanes];
      store(out, vexp(load_tail(x + whole, tail) - mx) * scale);
      std::memcpy(x + whole, out, tail * sizeof(T));
    }
    // The label's entry from its logit, rounded once: p * w - w.
    const vf gy = vexp(splat(xy) - mx) * scale - w;
    T one[kLanes];
    store(one, gy);
    x[y] = one[0];
  }
}

template <typename T>
struct XentBody {
  static PT_VEC void run(const XentJob& j, int64_t r0, int64_t r1) { xent_rows<T>(j, r0, r1); }
};

template <typename T>
void run_xent(const void* ctx, int64_t r0, int64_t r1) {
  dispatch<XentBody<T>>(*static_cast<const XentJob*>(ctx), r0, r1);
}

// ---- dst += src (fp32 += bf16) ------------------------------------------------------------------
// ATen's add_ of a bf16 tensor into an fp32 one casts the whole source into a temporary first.

struct AccumulateJob {
  float* dst;
  const uint16_t* src;
  int64_t n;
};

struct AccumulateBody {
  static PT_VEC void run(const AccumulateJob& j, int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) store(j.dst + v * kLanes, load(j.dst + v * kLanes) + load(j.src + v * kLanes));
  }
};

void run_accumulate(const void* ctx, int64_t v0, int64_t v1) {
  const AccumulateJob& j = *static_cast<const AccumulateJob*>(ctx);
  const int64_t whole = j.n / kLanes;
  if (v0 < std::min(v1, whole)) dispatch<AccumulateBody>(j, v0, std::min(v1, whole));
  if (v1 > whole)
    for (int64_t i = whole * kLanes; i < j.n; ++i) j.dst[i] += to_float(j.src[i]);
}

bool env_enabled() {
  const char* v = std::getenv("POLYTRAIN_CPU_KERNELS");
  return !(v && std::string(v) == "0");
}
std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag{env_enabled()};
  return flag;
}

}  // namespace

bool enabled() { return enabled_flag().load(std::memory_order_relaxed); }
void set_enabled(bool on) { enabled_flag().store(on, std::memory_order_relaxed); }

int set_vector_level(int level) {
  forced_level.store(level, std::memory_order_relaxed);
  return vector_level();
}

bool handles(const at::Tensor& x) {
  return enabled() && x.defined() && x.device().is_cpu() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  PT_CHECK(handles(x), "cpu_ops::gelu_tanh: takes fp32 or bf16 CPU tensors");
  return GeluFn::apply(x);
}

at::Tensor xent_grad_(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_weight, bool grad) {
  PT_CHECK(handles(logits) && logits.dim() == 2 && logits.stride(1) == 1,
           "cpu_ops::xent_grad_: logits must be [rows, cols], rows contiguous, fp32 or bf16 on the CPU");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  PT_CHECK(labels.scalar_type() == at::kLong && labels.numel() == rows && row_weight.scalar_type() == at::kFloat &&
               row_weight.numel() == rows,
           "cpu_ops::xent_grad_: labels int64 and row_weight fp32, one per row");
  const auto y = labels.contiguous();
  const auto w = row_weight.contiguous();
  if (rows > 0) {
    const auto bad = (y.lt(0) | y.ge(cols)).any().item<bool>();
    PT_CHECK(!bad, "cpu_ops::xent_grad_: a label is outside [0, ", cols, ")");
  }
  auto loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  const XentJob job{logits.data_ptr(), cols, logits.stride(0), y.data_ptr<int64_t>(), w.data_ptr<float>(),
                    loss.data_ptr<float>(), grad};
  const int parts = cpu_pool::parts_for(rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1)));
  if (logits.scalar_type() == at::kFloat) cpu_pool::run(run_xent<float>, &job, rows, parts);
  else cpu_pool::run(run_xent<uint16_t>, &job, rows, parts);
  return loss;
}

void accumulate_(at::Tensor& dst, const at::Tensor& src) {
  PT_CHECK(enabled() && dst.device().is_cpu() && src.device().is_cpu() && dst.scalar_type() == at::kFloat &&
               dst.is_contiguous() && src.sizes() == dst.sizes(),
           "cpu_ops::accumulate_: dst must be a contiguous fp32 CPU tensor of src's shape");
  if (src.scalar_type() != at::kBFloat16) {
    dst.add_(src);
    return;
  }
  const auto s = src.contiguous();
  const AccumulateJob job{dst.data_ptr<float>(), static_cast<const uint16_t*>(s.data_ptr()), dst.numel()};
  const int64_t units = (job.n + kLanes - 1) / kLanes;
  cpu_pool::run(run_accumulate, &job, units, cpu_pool::parts_for(units, 4096));
}

}  // namespace polytrain::cpu_ops
