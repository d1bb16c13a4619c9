// Causal self-attention on the CPU (cpu_ops.h: causal_attention). Per (batch, head), on one
// thread each (cpu_pool's threads over B x H, the GEMM libraries held to the calling thread):
// the queries in row blocks of kTile, each block's scores against only the keys it sees, the
// softmax (and dropout) in place on the block's rows, and its context. The backward runs the
// query blocks for the score gradients and dQ, then key blocks for dK and dV. q, k and v are read
// where the fused projection wrote them (rows 3 H D apart) and ctx is written in place, so the
// head transposes and their copies of the eager path go away, and the scores above the
// diagonal are never computed (5/8 of the products at L = 4 tiles).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "polytrain/common/error.h"
#include "polytrain/models/cpu_dropout.h"
#include "polytrain/ops/cpu_gemm.h"
#include "polytrain/ops/cpu_ops.h"
#include "polytrain/ops/cpu_vec.h"
#include "polytrain/optim/worker_pool.h"

namespace polytrain::cpu_ops {
namespace {

using namespace vec;
using at::Tensor;

constexpr int64_t kTile = 64;  // query rows a block (32 and 128 measured no faster at L = 256, 256 slower)

struct Shape {
  int64_t batch, len, heads, dim;  // B, L, H, D
  int64_t e() const { return heads * dim; }
  int64_t tiles() const { return (len + kTile - 1) / kTile; }
};

struct Drop {
  bool on;
  uint64_t seed;
  uint32_t threshold;
  float scale;  // 1 / (1 - p)
};

// out[c] = the multiplier of element e0 + c of the probabilities, c in [0, n).
PT_VEC void keep_multipliers(const Drop& d, int64_t e0, int64_t n, float* out) {
  int64_t c = 0;
  float m[16];
  if (e0 % 16 != 0) {  // the first block's part
    dropout_block_multipliers(d.seed, d.threshold, d.scale, e0 / 16, m);
    c = std::min(n, 16 - e0 % 16);
    std::memcpy(out, m + e0 % 16, c * sizeof(float));
  }
  for (; c + 16 <= n; c += 16)  // e0 + c is a block's start
    dropout_block_multipliers(d.seed, d.threshold, d.scale, (e0 + c) / 16, out + c);
  if (c < n) {
    dropout_block_multipliers(d.seed, d.threshold, d.scale, (e0 + c) / 16, m);
    std::memcpy(out + c, m, (n - c) * sizeof(float));
  }
}

// Loads and stores of a row's last r < 16 entries through a copy padded with `pad`.
PT_VEC vf load_n(const float* p, int64_t r, float pad) {
  float buf[kLanes];
  std::fill(buf, buf + kLanes, pad);
  std::memcpy(buf, p, r * sizeof(float));
  return load(buf);
}
PT_VEC void store_n(float* p, vf v, int64_t r) {
  float buf[kLanes];
  store(buf, v);
  std::memcpy(p, buf, r * sizeof(float));
}

// (No lambdas below: a lambda would not inherit the AVX-512 / AVX2 target of its caller.)

// Row x[0, nc): softmax over its first n entries (the keys the query sees), 0 beyond.
template <int Isa>
PT_VEC void softmax_row(float* x, int64_t n, int64_t nc) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  vf m = splat(-inf);
  for (int64_t c = 0; c < whole; c += kLanes) {
    const vf v = load(x + c);
    m = running_max<Isa>(m, v);
  }
  if (tail) {
    const vf v = load_n(x + whole, tail, -inf);
    m = running_max<Isa>(m, v);
  }
  const float mx = lanes_max(m);
  vf s = splat(0.0f);
  for (int64_t c = 0; c < whole; c += kLanes) {
    const vf e = vexp<Isa>(load(x + c) - mx);
    s += e;
    store<Isa>(x + c, e);
  }
  vf et{};
  if (tail) {
    et = vexp<Isa>(load_n(x + whole, tail, -inf) - mx);
    s += et;
  }
  const float inv = 1.0f / lanes_sum(s);
  for (int64_t c = 0; c < whole; c += kLanes) store<Isa>(x + c, load(x + c) * inv);
  if (tail) store_n(x + whole, et * inv, tail);
  std::fill(x + n, x + nc, 0.0f);
}

// g[0, n) = scale * p * (g - sum(p * g)): the softmax's backward (p is 0 beyond the diagonal).
PT_VEC void softmax_grad_row(const float* p, float* g, int64_t n, float scale) {
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  vf s = splat(0.0f);
  for (int64_t c = 0; c < whole; c += kLanes) s += load(p + c) * load(g + c);
  if (tail) s += load_n(p + whole, tail, 0.0f) * load_n(g + whole, tail, 0.0f);
  const float dot = lanes_sum(s);
  for (int64_t c = 0; c < whole; c += kLanes) store(g + c, scale * load(p + c) * (load(g + c) - dot));
  if (tail) store_n(g + whole, scale * load_n(p + whole, tail, 0.0f) * (load_n(g + whole, tail, 0.0f) - dot), tail);
}

// dst[0, n) = a * m (dst may be a).
PT_VEC void multiply_row(float* dst, const float* a, const float* m, int64_t n) {
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  for (int64_t c = 0; c < whole; c += kLanes) store(dst + c, load(a + c) * load(m + c));
  if (tail) store_n(dst + whole, load_n(a + whole, tail, 0.0f) * load_n(m + whole, tail, 0.0f), tail);
}

struct Job {
  Shape s;
  float scale;
  Drop drop;
  const float* qkv;  // [B, L, 3 E]
  float* probs;      // [B, H, L, L]: forward writes, backward reads
  float* ctx;        // forward: [B, L, E] out
  const float* grad; // backward: d ctx [B, L, E]
  float* dqkv;       // backward: [B, L, 3 E] out
};

// Tile i's query rows [r0, r0 + nr) and the keys they see, [0, nc).
struct Tile {
  int64_t r0, nr, nc;
};
Tile tile(const Shape& s, int64_t i) {
  const int64_t r0 = i * kTile, nr = std::min(kTile, s.len - r0);
  return {r0, nr, r0 + nr};
}

// The probabilities a GEMM takes for tile t's rows (row stride L): as they are without
// dropout; with it, their dropped copy in w (row stride ldw), and `also` (rows ldw apart, or
// null) multiplied by the same mask in place.
struct Operand {
  const float* data;
  int64_t ld;
};
PT_VEC Operand dropped(const Job& j, int64_t bh, const Tile& t, const float* rows, float* w, int64_t ldw, float* mult,
                       float* also) {
  const int64_t L = j.s.len;
  if (!j.drop.on) return {rows, L};
  for (int64_t r = 0; r < t.nr; ++r) {
    keep_multipliers(j.drop, (bh * L + t.r0 + r) * L, t.nc, mult);
    multiply_row(w + r * ldw, rows + r * L, mult, t.nc);
    if (also) multiply_row(also + r * ldw, also + r * ldw, mult, t.nc);
  }
  return {w, ldw};
}

struct Forward {
  template <int Isa>
  static PT_VEC void run(const Job& j, int64_t bh0, int64_t bh1) {
    const Shape& s = j.s;
    const int64_t E = s.e(), ld = 3 * E, L = s.len;
    std::vector<float> w(j.drop.on ? static_cast<size_t>(kTile * L) : 0), mult(j.drop.on ? L : 0);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const float* q = j.qkv + b * L * ld + h * s.dim;
      const float *k = q + E, *v = q + 2 * E;
      float* p = j.probs + bh * L * L;
      float* o = j.ctx + b * L * E + h * s.dim;
      for (int64_t i = 0; i < s.tiles(); ++i) {
        const Tile t = tile(s, i);
        float* rows = p + t.r0 * L;
        cpu_gemm::sgemm('N', 'T', t.nr, t.nc, s.dim, j.scale, q + t.r0 * ld, ld, k, ld, 0.0f, rows, L);
        for (int64_t r = 0; r < t.nr; ++r) softmax_row<Isa>(rows + r * L, t.r0 + r + 1, t.nc);
        const Operand a = dropped(j, bh, t, rows, w.data(), t.nc, mult.data(), nullptr);
        cpu_gemm::sgemm('N', 'N', t.nr, s.dim, t.nc, 1.0f, a.data, a.ld, v, ld, 0.0f, o + t.r0 * E, E);
      }
    }
  }
};

// Two passes a (b, h): by query tile, d scores (kept whole, [L, L]) and dQ; then by key tile,
// dK and dV, each one product over every query row that sees the tile's keys.
struct Backward {
  template <int Isa>
  static PT_VEC void run(const Job& j, int64_t bh0, int64_t bh1) {
    const Shape& s = j.s;
    const int64_t E = s.e(), ld = 3 * E, L = s.len;
    std::vector<float> ds(static_cast<size_t>(L * L)), w(j.drop.on ? static_cast<size_t>(L * L) : 0),
        mult(j.drop.on ? L : 0);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const float* q = j.qkv + b * L * ld + h * s.dim;
      const float *k = q + E, *v = q + 2 * E;
      const float* p = j.probs + bh * L * L;
      const float* go = j.grad + b * L * E + h * s.dim;
      float* dq = j.dqkv + b * L * ld + h * s.dim;
      float *dk = dq + E, *dv = dq + 2 * E;
      // The probabilities dV takes: the dropped ones (w) with dropout.
      const float* pv = j.drop.on ? w.data() : p;
      for (int64_t i = 0; i < s.tiles(); ++i) {
        const Tile t = tile(s, i);
        const float* rows = p + t.r0 * L;
        float* g = ds.data() + t.r0 * L;
        // d(dropped probs) = dO V^T; d scores = P * (dP - rowsum(P dP)) * scale; dQ = dS K.
        cpu_gemm::sgemm('N', 'T', t.nr, t.nc, s.dim, 1.0f, go + t.r0 * E, E, v, ld, 0.0f, g, L);
        dropped(j, bh, t, rows, w.data() + t.r0 * L, L, mult.data(), g);
        for (int64_t r = 0; r < t.nr; ++r) softmax_grad_row(rows + r * L, g + r * L, t.nc, j.scale);
        cpu_gemm::sgemm('N', 'N', t.nr, s.dim, t.nc, 1.0f, g, L, k, ld, 0.0f, dq + t.r0 * ld, ld);
      }
      // Key tile c: the rows from its first key on see it (the entries above the diagonal are 0).
      for (int64_t c = 0; c < s.tiles(); ++c) {
        const Tile t = tile(s, c);
        const int64_t k0 = t.r0, nk = t.nr, rows = L - k0;
        cpu_gemm::sgemm('T', 'N', nk, s.dim, rows, 1.0f, ds.data() + k0 * L + k0, L, q + k0 * ld, ld, 0.0f, dk + k0 * ld, ld);
        cpu_gemm::sgemm('T', 'N', nk, s.dim, rows, 1.0f, pv + k0 * L + k0, L, go + k0 * E, E, 0.0f, dv + k0 * ld, ld);
      }
    }
  }
};

// (b, h) pairs [b0, b1) of the job, on one pool thread, each product on that thread alone.
template <typename Body>
void run_part(const void* ctx, int64_t b0, int64_t b1) {
  const cpu_gemm::SingleThreaded one;
  dispatch<Body>(*static_cast<const Job*>(ctx), b0, b1);
}

template <typename Body>
void run(const Job& j) {
  const int64_t pairs = j.s.batch * j.s.heads;
  cpu_pool::run(run_part<Body>, &j, pairs, cpu_pool::parts_for(pairs, 1));
}

Job make_job(const Tensor& qkv, int64_t heads, double scale, const Drop& drop) {
  const Shape s{qkv.size(0), qkv.size(1), heads, qkv.size(2) / 3 / heads};
  return Job{s, static_cast<float>(scale), drop, qkv.data_ptr<float>(), nullptr, nullptr, nullptr, nullptr};
}

Drop make_drop(double p, int64_t seed) {
  if (p <= 0.0) return Drop{false, 0, 0, 1.0f};
  return Drop{true, static_cast<uint64_t>(seed), dropout_keep_threshold(p), static_cast<float>(1.0 / (1.0 - p))};
}

struct CausalAttentionFn : torch::autograd::Function<CausalAttentionFn> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& qkv_in, int64_t heads, double scale,
                        double p, int64_t seed) {
    const auto qkv = qkv_in.contiguous();
    Job j = make_job(qkv, heads, scale, make_drop(p, seed));
    auto probs = at::empty({j.s.batch, heads, j.s.len, j.s.len}, qkv.options());
    auto out = at::empty({j.s.batch, j.s.len, j.s.e()}, qkv.options());
    j.probs = probs.data_ptr<float>();
    j.ctx = out.data_ptr<float>();
    run<Forward>(j);
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& qkv = saved[0];
    auto probs = saved[1];
    Job j = make_job(qkv, ctx->saved_data["heads"].toInt(), ctx->saved_data["scale"].toDouble(),
                     make_drop(ctx->saved_data["p"].toDouble(), ctx->saved_data["seed"].toInt()));
    const auto grad = grads[0].to(at::kFloat).contiguous();
    auto dqkv = at::empty_like(qkv, at::MemoryFormat::Contiguous);
    j.probs = probs.data_ptr<float>();
    j.grad = grad.data_ptr<float>();
    j.dqkv = dqkv.data_ptr<float>();
    run<Backward>(j);
    return {dqkv, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool causal_attention_handles(const at::Tensor& qkv, int64_t heads) {
  return enabled() && qkv.defined() && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 &&
         heads > 0 && qkv.size(2) % (3 * heads) == 0 && qkv.size(2) > 0 && qkv.size(1) > 0;
}

at::Tensor causal_attention(const at::Tensor& qkv, int64_t heads, double scale, double dropout_p, uint64_t seed) {
  PT_CHECK(causal_attention_handles(qkv, heads),
           "cpu_ops::causal_attention: qkv must be an fp32 CPU [B, L, 3 x heads x D] tensor, got ",
           qkv.sizes(), " ", qkv.scalar_type(), " with ", heads, " heads");
  PT_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "cpu_ops::causal_attention: dropout must be in [0, 1), got ", dropout_p);
  return CausalAttentionFn::apply(qkv, heads, scale, dropout_p, static_cast<int64_t>(seed));
}

}  // namespace polytrain::cpu_ops
