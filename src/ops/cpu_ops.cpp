#include "polytrain/ops/cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/ops/cpu_vec.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain::cpu_ops {
namespace {

using namespace vec;

// ---- GELU -----------------------------------------------------------------------------------

constexpr float kSqrt2OverPi = 0.7978845608028654f, kTanhCubic = 0.044715f;

// GELU's tanh form through q = 1 - tanh(u) = 2 / (E + 1), E = e^2u, which has no
// cancellation: 1 + tanh(u) = E q (u < 0) or 2 - q (u >= 0), and 1 - tanh(u)^2 = q (1 + tanh(u)).
struct TanhParts {
  vf q, one_plus;
};
template <int Isa>
PT_VEC TanhParts tanh_parts(vf x) {
  const vf e = vexp<Isa>(2.0f * (kSqrt2OverPi * (x + kTanhCubic * x * x * x)));
  const vf q = 2.0f / (e + 1.0f);
  return {q, select_gt<Isa>(splat(0.0f), x, e * q, 2.0f - q)};
}

template <int Isa>
PT_VEC vf gelu_fwd(vf x) {
  return 0.5f * x * tanh_parts<Isa>(x).one_plus;
}

template <int Isa>
PT_VEC vf gelu_grad(vf x) {  // d gelu / dx
  const TanhParts t = tanh_parts<Isa>(x);
  return 0.5f * t.one_plus + 0.5f * x * t.q * t.one_plus * kSqrt2OverPi * (1.0f + 3.0f * kTanhCubic * x * x);
}


struct GeluJob {
  const void* x;
  const void* g;  // backward: the incoming gradient; null in forward
  void* out;
  int64_t n;
};

template <typename T, int Isa>
PT_VEC void gelu_vectors(const GeluJob& j, int64_t v0, int64_t v1) {
  const T* x = static_cast<const T*>(j.x) + v0 * kLanes;
  const T* g = j.g ? static_cast<const T*>(j.g) + v0 * kLanes : nullptr;
  T* out = static_cast<T*>(j.out) + v0 * kLanes;
  for (int64_t v = v0; v < v1; ++v, x += kLanes, out += kLanes) {
    if (g) {
      store<Isa>(out, load(g) * gelu_grad<Isa>(load(x)));
      g += kLanes;
    } else {
      store<Isa>(out, gelu_fwd<Isa>(load(x)));
    }
  }
}

template <typename T>
struct GeluBody {
  template <int Isa>
  static PT_VEC void run(const GeluJob& j, int64_t v0, int64_t v1) {
    gelu_vectors<T, Isa>(j, v0, v1);
  }
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

// Rows [r0, r1): max (one read), sum of exponentials (one read, from cache: a GPT-2 row is
// 100-200 KB), then the gradient (exponentials again, one write).
template <typename T, int Isa>
PT_VEC void xent_rows(const XentJob& j, int64_t r0, int64_t r1) {
  const int64_t cols = j.cols, whole = cols / kLanes * kLanes, tail = cols - whole;
  for (int64_t r = r0; r < r1; ++r) {
    T* x = static_cast<T*>(j.logits) + r * j.ld;
    vf m = splat(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < whole; c += kLanes) {
      const vf v = load(x + c);
      m = running_max<Isa>(m, v);
    }
    if (tail) {
      const vf v = load_tail(x + whole, tail);
      m = running_max<Isa>(m, v);
    }
    const float mx = lanes_max(m);
    vf s = splat(0.0f);
    for (int64_t c = 0; c < whole; c += kLanes) s += vexp<Isa>(load(x + c) - mx);
    if (tail) s += vexp<Isa>(load_tail(x + whole, tail) - mx);
    const float sum = lanes_sum(s), w = j.weight[r];
    const int64_t y = j.labels[r];
    const float xy = to_float(x[y]);
    j.row_loss[r] = w * (mx + std::log(sum) - xy);
    if (!j.grad) continue;
    const float scale = w / sum;
    for (int64_t c = 0; c < whole; c += kLanes) store<Isa>(x + c, vexp<Isa>(load(x + c) - mx) * scale);
    if (tail) {
      T out[kLanes];
      store<Isa>(out, vexp<Isa>(load_tail(x + whole, tail) - mx) * scale);
      std::memcpy(x + whole, out, tail * sizeof(T));
    }
    // The label's entry from its logit, rounded once: p * w - w.
    const vf gy = vexp<Isa>(splat(xy) - mx) * scale - w;
    T one[kLanes];
    store<Isa>(one, gy);
    x[y] = one[0];
  }
}

template <typename T>
struct XentBody {
  template <int Isa>
  static PT_VEC void run(const XentJob& j, int64_t r0, int64_t r1) {
    xent_rows<T, Isa>(j, r0, r1);
  }
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
  template <int Isa>
  static PT_VEC void run(const AccumulateJob& j, int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) store<Isa>(j.dst + v * kLanes, load(j.dst + v * kLanes) + load(j.src + v * kLanes));
  }
};

void run_accumulate(const void* ctx, int64_t v0, int64_t v1) {
  const AccumulateJob& j = *static_cast<const AccumulateJob*>(ctx);
  const int64_t whole = j.n / kLanes;
  if (v0 < std::min(v1, whole)) dispatch<AccumulateBody>(j, v0, std::min(v1, whole));
  if (v1 > whole)
    for (int64_t i = whole * kLanes; i < j.n; ++i) j.dst[i] += to_float(j.src[i]);
}

constexpr int64_t kSquaresBlock = 4096;  // elements per partial sum (one pool unit)

struct SquaresJob {
  const void* x;
  bool bf16;
  int64_t n;
  double* block_sums;  // one per block
};

typedef double vd __attribute__((vector_size(kLanes * sizeof(double))));  // 16 doubles

template <typename T>
struct SquaresBody {
  template <int Isa>
  static PT_VEC void run(const SquaresJob& j, int64_t b0, int64_t b1) {
    const T* x = static_cast<const T*>(j.x);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kSquaresBlock, end = std::min(j.n, begin + kSquaresBlock);
      const int64_t whole = begin + (end - begin) / kLanes * kLanes;
      vd acc{};
      for (int64_t i = begin; i < whole; i += kLanes) {
        const vd v = __builtin_convertvector(load(x + i), vd);
        acc += v * v;
      }
      double sum = 0.0;
      for (int k = 0; k < kLanes; ++k) sum += acc[k];
      for (int64_t i = whole; i < end; ++i) sum += static_cast<double>(to_float(x[i])) * to_float(x[i]);
      j.block_sums[b] = sum;
    }
  }
};

void run_squares(const void* ctx, int64_t b0, int64_t b1) {
  const SquaresJob& j = *static_cast<const SquaresJob*>(ctx);
  if (j.bf16) dispatch<SquaresBody<uint16_t>>(j, b0, b1);
  else dispatch<SquaresBody<float>>(j, b0, b1);
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
  vec::forced_level.store(level, std::memory_order_relaxed);
  return vec::vector_level();
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

double sum_of_squares(const at::Tensor& x) {
  PT_CHECK(handles(x) && x.is_contiguous(), "cpu_ops::sum_of_squares: x must be a contiguous fp32 or bf16 CPU tensor");
  const int64_t n = x.numel(), blocks = (n + kSquaresBlock - 1) / kSquaresBlock;
  if (n == 0) return 0.0;
  std::vector<double> sums(blocks);
  const SquaresJob job{x.data_ptr(), x.scalar_type() == at::kBFloat16, n, sums.data()};
  cpu_pool::run(run_squares, &job, blocks, cpu_pool::parts_for(blocks, 16));
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace polytrain::cpu_ops
