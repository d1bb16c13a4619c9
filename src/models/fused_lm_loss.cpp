#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/tied_embedding.h"
#include "polytrain/models/tp_layers.h"

#include <algorithm>
#include <limits>

#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/error.h"
#include "polytrain/ops/cpu_gemm.h"
#include "polytrain/ops/cpu_ops.h"
#include "polytrain/ops/cuda_ops.h"

namespace polytrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor compute_dtype(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kDouble ? t : t.to(at::kFloat);
}

struct Grads {
  at::Tensor dh, dw, db;
};

// Sum over rows of weight[r] * (-log softmax(h W^T + b)[r, y[r]]) and, when g is given, the
// gradients of that sum with respect to h, W and b. Every row is projected (the same matmul
// FLOPs as the dense path); weight 0 rows (ignore_index) drop out of loss and gradients.
// One [chunk, V] logits buffer and one log-probability buffer are reused for every chunk.
// The gradient buffers the chunk loops fill (dh written row by row, dW and db accumulated).
// dw_overwritten: the first chunk writes dW (no zeros first, no accumulation into them).
void alloc_grads(Grads* g, const at::Tensor& h, const at::Tensor& w, const at::Tensor& b, bool need_h, bool need_w,
                 bool need_b, bool dw_overwritten = false) {
  if (!g) return;
  if (need_h) g->dh = at::empty_like(h);
  if (need_w) g->dw = dw_overwritten && h.size(0) > 0 ? at::empty_like(w) : at::zeros_like(w);
  if (need_b && b.defined()) g->db = at::zeros_like(b);
}

// The vocabulary padded to a multiple of `multiple` rows of the weight (zeros) with -inf in
// the bias's padded entries: their logits get probability 0, so loss and gradients are the
// unpadded ones. dtype: the padded copies' (the weight's own when unset). On a GPU a vocabulary like GPT-2's 50257 leaves every row of the [rows, V]
// logits misaligned and cuBLAS falls back to its slowest (align1) kernels: at 50304 the LM head's
// three GEMMs run at full speed (nanoGPT's and llm.c's padded vocabulary; inductor pads too).
struct Padded {
  at::Tensor w, b;
  int64_t vocab = 0;  ///< the real vocabulary; 0 when nothing was padded
};

Padded pad_vocab(const at::Tensor& w, const at::Tensor& b, int64_t multiple,
                 std::optional<at::ScalarType> dtype = std::nullopt) {
  const at::ScalarType t = dtype.value_or(w.scalar_type());
  Padded p{w.to(t), b.defined() ? b.to(t) : b, 0};
  const int64_t v = w.size(0);
  if (multiple <= 1 || v % multiple == 0) return p;
  const int64_t vp = (v + multiple - 1) / multiple * multiple;
  p.vocab = v;
  p.w = at::empty({vp, w.size(1)}, w.options().dtype(t));
  p.w.narrow(0, 0, v).copy_(w);  // the cast to dtype in the same pass
  p.w.narrow(0, v, vp - v).zero_();
  p.b = at::full({vp}, -std::numeric_limits<double>::infinity(), w.options().dtype(t));
  if (b.defined())
    p.b.narrow(0, 0, v).copy_(b);
  else
    p.b.narrow(0, 0, v).zero_();
  return p;
}

// The CPU's bf16 chunks (hm: the rows already in bf16): the cross-entropy chain is one kernel
// in place on the logits, which become their own gradient (row weight applied); dW is written by
// the first chunk and accumulated in fp32 after. Where oneDNN's bf16 GEMM API runs
// (cpu_gemm::bf16_gemm_available: AVX512-BF16 without AMX), dh and dW come from it in fp32
// straight into their buffers. Elsewhere ATen's bf16 matmul runs them: the vocabulary is padded
// to a multiple of 64 inside (zero weight rows, -inf logits: the same loss and gradients) and
// dh is formed as (W^T G^T)^T, which at GPT-2's 50257 rows took oneDNN's matmul primitive from
// 660 to 890 GFLOP/s (dW) and from 700 to 860 (dh) (Zen 5, 2 threads, 1020 x 50257 x 768).
at::Tensor reduced_cpu_chunks(const at::Tensor& hm, const at::Tensor& w, const at::Tensor& b, const at::Tensor& y,
                              const at::Tensor& row_weight, int64_t chunk, bool need_h, bool need_w, Grads* g,
                              at::ScalarType reduced, at::Tensor loss) {
  const int64_t n = hm.size(0), v = w.size(0), hsz = hm.size(1);
  const bool direct = cpu_gemm::bf16_gemm_available() && hm.is_contiguous() &&
                      (!g || ((!need_w || g->dw.is_contiguous()) && (!need_h || g->dh.is_contiguous())));
  const auto p = pad_vocab(w, b, direct ? 1 : 64, reduced);
  const int64_t vp = p.w.size(0);
  // Without a bias of its own (GPT-2's head) the padded logits get -inf from a fill, not from a
  // bias added by every product.
  const at::Tensor wm = p.w.contiguous(), wmt = wm.t(), bm = b.defined() ? p.b : at::Tensor();
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t c = std::min(chunk, n - i);
    auto hc = hm.narrow(0, i, c);
    auto gl = bm.defined() ? at::addmm(bm, hc, wmt) : at::mm(hc, wmt);
    if (vp != v && !bm.defined()) gl.narrow(1, v, vp - v).fill_(-std::numeric_limits<double>::infinity());
    loss.add_(cpu_ops::xent_grad_(gl, y.narrow(0, i, c), row_weight.narrow(0, i, c), g != nullptr).sum());
    if (!g) continue;
    if (g->db.defined()) g->db.add_(gl.narrow(1, 0, v).sum(0, false, at::kFloat));
    if (direct) {  // fp32 straight into the gradients (vp == v)
      const auto* gp = gl.data_ptr<at::BFloat16>();
      if (need_h)
        cpu_gemm::gemm_bf16('N', 'N', c, hsz, v, 1.0f, gp, v, wm.data_ptr<at::BFloat16>(), hsz, 0.0f,
                            g->dh.data_ptr<float>() + i * hsz, hsz);
      if (need_w)
        cpu_gemm::gemm_bf16('T', 'N', v, hsz, c, 1.0f, gp, v, hc.data_ptr<at::BFloat16>(), hsz, i == 0 ? 0.0f : 1.0f,
                            g->dw.data_ptr<float>(), hsz);
      continue;
    }
    if (need_h) g->dh.narrow(0, i, c).copy_(at::mm(wmt, gl.t()).t());
    if (!need_w) continue;
    auto dw = at::mm(gl.t(), hc).narrow(0, 0, v);
    if (i == 0) g->dw.copy_(dw);
    else cpu_ops::accumulate_(g->dw, dw);
  }
  return loss;
}

// reduced: the dtype of the matmul operands when it is not h's (bf16 or fp16 under autocast on
// a GPU, bf16 on a CPU): logits in that dtype, log-softmax and every accumulator (loss, dh, dW, db) in fp32.
at::Tensor reduced_chunked_loss(const at::Tensor& h, const at::Tensor& w, const at::Tensor& b, const at::Tensor& y,
                                const at::Tensor& row_weight, int64_t chunk, bool need_h, bool need_w, bool need_b,
                                Grads* g, at::ScalarType reduced) {
  const int64_t n = h.size(0);
  auto loss = at::zeros({}, h.options());
  const auto hm = h.to(reduced);
  const bool cpu_kernel = !h.is_cuda() && cpu_ops::handles(hm);
  alloc_grads(g, h, w, b, need_h, need_w, need_b, /*dw_overwritten=*/cpu_kernel);
  if (n == 0) return loss;
  chunk = std::min(chunk, n);
  if (cpu_kernel) return reduced_cpu_chunks(hm, w, b, y, row_weight, chunk, need_h, need_w, g, reduced, loss);
  const auto wm = w.to(reduced), wmt = wm.t();
  const auto bm = b.defined() ? b.to(reduced) : b;
  if (h.is_cuda() && cuda_ops::available()) {
    // One kernel for the whole cross-entropy chain: the reduced logits become their own
    // gradient (row weight applied), the row losses come back in fp32.
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t c = std::min(chunk, n - i);
      auto hc = hm.narrow(0, i, c);
      auto gl = bm.defined() ? at::addmm(bm, hc, wmt) : at::mm(hc, wmt);
      loss.add_(cuda_ops::xent_grad_(gl, y.narrow(0, i, c), row_weight.narrow(0, i, c)).sum());
      if (!g) continue;
      if (g->db.defined()) g->db.add_(gl.sum(0, false, at::kFloat));
      if (need_h) g->dh.narrow(0, i, c).copy_(at::mm(gl, wm));
      if (need_w) g->dw.add_(at::mm(gl.t(), hc));
    }
    return loss;
  }
  auto minus_one = at::full({chunk, 1}, -1.0, h.options());
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t c = std::min(chunk, n - i);
    auto hc = hm.narrow(0, i, c);
    auto yc = y.narrow(0, i, c).unsqueeze(1);
    auto rw = row_weight.narrow(0, i, c);
    auto logits = bm.defined() ? at::addmm(bm, hc, wmt) : at::mm(hc, wmt);
    // half_to_float exists for fp16 on CUDA only (not bf16, not the CPU): else upcast first.
    auto logp = logits.is_cuda() && logits.scalar_type() == at::kHalf
                    ? at::_log_softmax(logits, 1, /*half_to_float=*/true)
                    : at::_log_softmax(logits.to(at::kFloat), 1, false);
    logits = at::Tensor();
    loss.sub_(at::dot(logp.gather(1, yc).squeeze(1), rw));
    if (!g) continue;
    auto p = logp.exp_();
    p.scatter_add_(1, yc, minus_one.narrow(0, 0, c));
    auto rw_col = rw.unsqueeze(1);
    if (g->db.defined()) g->db.addmv_(p.t(), rw);
    auto pm = p.to(reduced);
    p = logp = at::Tensor();
    if (need_h) g->dh.narrow(0, i, c).copy_(at::mm(pm, wm).mul_(rw_col.to(reduced)));
    if (need_w) g->dw.add_(at::mm(pm.t(), (h.narrow(0, i, c) * rw_col).to(reduced)));
  }
  return loss;
}

void project_out(at::Tensor& logits, const at::Tensor& hc, const at::Tensor& wt, const at::Tensor& b) {
  if (b.defined()) {
    at::addmm_out(logits, b, hc, wt);
  } else {
    at::mm_out(logits, hc, wt);
  }
}

at::Tensor chunked_loss(const at::Tensor& h, const at::Tensor& w, const at::Tensor& b, const at::Tensor& y,
                        const at::Tensor& row_weight, int64_t chunk, bool need_h, bool need_w, bool need_b,
                        Grads* g, at::ScalarType reduced = at::kFloat) {
  if ((reduced == at::kBFloat16 || reduced == at::kHalf) && reduced != h.scalar_type())
    return reduced_chunked_loss(h, w, b, y, row_weight, chunk, need_h, need_w, need_b, g, reduced);
  const int64_t n = h.size(0), v = w.size(0);
  auto loss = at::zeros({}, h.options());
  alloc_grads(g, h, w, b, need_h, need_w, need_b, /*dw_overwritten=*/cpu_ops::handles(h));
  if (n == 0) return loss;
  chunk = std::min(chunk, n);
  auto wt = w.t();
  auto logits_buf = at::empty({chunk, v}, h.options());
  if (cpu_ops::handles(h)) {  // fp32 on the CPU: the chain in one kernel, in place on the logits
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t c = std::min(chunk, n - i);
      auto hc = h.narrow(0, i, c);
      auto gl = logits_buf.narrow(0, 0, c);
      project_out(gl, hc, wt, b);
      loss.add_(cpu_ops::xent_grad_(gl, y.narrow(0, i, c), row_weight.narrow(0, i, c), g != nullptr).sum());
      if (!g) continue;
      if (need_h) {
        auto dhc = g->dh.narrow(0, i, c);
        at::mm_out(dhc, gl, w);
      }
      if (need_w && i == 0) at::mm_out(g->dw, gl.t(), hc);
      else if (need_w) g->dw.addmm_(gl.t(), hc);
      if (g->db.defined()) g->db.add_(gl.sum(0));
    }
    return loss;
  }
  auto logp_buf = at::empty({chunk, v}, h.options());
  auto minus_one = at::full({chunk, 1}, -1.0, h.options());
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t c = std::min(chunk, n - i);
    auto hc = h.narrow(0, i, c);
    auto yc = y.narrow(0, i, c).unsqueeze(1);
    auto rw = row_weight.narrow(0, i, c);
    auto logits = logits_buf.narrow(0, 0, c);
    project_out(logits, hc, wt, b);
    auto logp = logp_buf.narrow(0, 0, c);
    at::_log_softmax_out(logp, logits, 1, false);
    loss.sub_(at::dot(logp.gather(1, yc).squeeze(1), rw));
    if (!g) continue;
    // d(sum)/d(logits) = weight[r] * (softmax - onehot); the row weight is applied to the
    // thin [c, H] operands and a gemv instead of another pass over the [c, V] block.
    auto p = logp.exp_();
    p.scatter_add_(1, yc, minus_one.narrow(0, 0, c));
    auto rw_col = rw.unsqueeze(1);
    if (need_h) {
      auto dhc = g->dh.narrow(0, i, c);
      at::mm_out(dhc, p, w).mul_(rw_col);
    }
    if (need_w) g->dw.addmm_(p.t(), hc * rw_col);
    if (g->db.defined()) g->db.addmv_(p.t(), rw);
  }
  return loss;
}

// CPU: ~32 MB of fp32 logits per chunk (cache-sized), with a log-probability buffer beside it.
// CPU through cpu_ops: ~256 MB of logits (fp32 or bf16) and nothing beside them: the kernel
// works row by row in cache, and each chunk is one more pass over the fp32 [V, H] dW and a
// GEMM whose inner size is the chunk's rows (GPT-2 at 1024 tokens, bf16: 7 chunks and 158 ms
// of dW additions a step became 1 chunk; fp32: 2 chunks cost 5% of the head's forward and
// backward against the dense path, 1 chunk 2%). GPU: ~1 GiB, so each chunk's matmuls fill the device
// (GPT-2: ~5300 rows, a dozen chunks at 64 x 1024 tokens).
int64_t default_chunk(int64_t v, bool gpu, at::ScalarType mm) {
  const int64_t bytes = gpu ? int64_t{1} << 30 : cpu_ops::enabled() ? int64_t{256} << 20 : int64_t{32} << 20;
  return std::max<int64_t>(16, bytes / ((gpu || mm == at::kFloat ? 4 : 2) * std::max<int64_t>(v, 1)));
}

// The matmul dtype: the autocast dtype under autocast (on a CPU: bf16, whose matmuls oneDNN
// runs on AVX512-BF16 / AMX: the head is a third of GPT-2 small's FLOPs), else fp32.
at::ScalarType matmul_dtype(const at::Tensor& hidden) {
  if (!hidden.is_cuda()) return autocast_type(c10::DeviceType::CPU) == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  return autocast_type(c10::DeviceType::CUDA).value_or(at::kFloat);
}

// Flattened rows, labels made safe for gather (ignore_index -> 0) and weights 1/n or 0.
struct Rows {
  at::Tensor h, y, weight;
  int64_t labelled;   ///< on the CPU
  at::Tensor count;   ///< on a GPU: the labelled count stays there (no host sync); labelled is -1
};

Rows flatten(const at::Tensor& hidden, const at::Tensor& labels, int64_t ignore_index) {
  Rows r;
  r.h = compute_dtype(hidden).reshape({-1, hidden.size(-1)}).contiguous();
  auto y = labels.reshape({-1});
  auto valid = y.ne(ignore_index);
  if (hidden.is_cuda()) {
    r.labelled = -1;
    r.count = valid.sum();
    r.y = y.masked_fill(~valid, 0);
    r.weight = valid.to(r.h.scalar_type()) / r.count.clamp_min(1).to(r.h.scalar_type());
    return r;
  }
  r.labelled = valid.sum().item<int64_t>();
  r.y = y.masked_fill(~valid, 0);
  // 0/0 -> NaN loss when nothing is labelled, as torch's cross_entropy.
  const double inv = r.labelled > 0 ? 1.0 / static_cast<double>(r.labelled) : std::nan("");
  r.weight = valid.to(r.h.scalar_type()) * inv;
  if (r.labelled == 0) r.weight.zero_();
  return r;
}

at::Tensor finish(const at::Tensor& sum, const Rows& r, at::ScalarType dtype) {
  if (r.count.defined()) return at::where(r.count.gt(0), sum, at::full({}, std::nan(""), sum.options())).to(dtype);
  auto loss = r.labelled > 0 ? sum : at::full({}, std::nan(""), sum.options());
  return loss.to(dtype);
}

int64_t pad_multiple(const at::Tensor& hidden, int64_t asked) { return asked > 0 ? asked : hidden.is_cuda() ? 64 : 1; }

struct FusedLinearCE : torch::autograd::Function<FusedLinearCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& bias_or_empty, const at::Tensor& labels, int64_t ignore_index,
                            int64_t chunk, int64_t matmul, int64_t pad) {
    // libtorch 1.13's Function::apply rejects undefined inputs: "no bias" arrives as numel 0.
    const at::Tensor bias = bias_or_empty.numel() > 0 ? bias_or_empty : at::Tensor();
    auto rows = flatten(hidden, labels, ignore_index);
    Grads g;
    const auto p = pad_vocab(compute_dtype(weight), bias.defined() ? compute_dtype(bias) : bias, pad);
    auto sum = chunked_loss(rows.h, p.w, p.b, rows.y, rows.weight, chunk, ctx->needs_input_grad(0),
                            ctx->needs_input_grad(1), bias.defined() && ctx->needs_input_grad(2), &g,
                            static_cast<at::ScalarType>(matmul));
    if (p.vocab > 0) {  // the padded rows' gradients are zero and not the model's
      if (g.dw.defined()) g.dw = g.dw.narrow(0, 0, p.vocab);
      if (g.db.defined()) g.db = g.db.narrow(0, 0, p.vocab);
    }
    if (g.dh.defined()) ctx->saved_data["dh"] = g.dh.to(hidden.scalar_type()).reshape(hidden.sizes());
    if (g.dw.defined()) {
      ctx->saved_data["dw"] = g.dw.to(weight.scalar_type()).contiguous();
      ctx->saved_data["tied"] = tied_embedding::lookups_below(hidden, weight);  // embeddings sharing the weight
    }
    if (g.db.defined()) ctx->saved_data["db"] = g.db.to(bias.scalar_type()).contiguous();
    return finish(sum, rows, hidden.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto& go = grad_out[0];
    variable_list grads(8);
    auto& sd = ctx->saved_data;
    if (sd.count("dh")) grads[0] = sd["dh"].toTensor() * go;
    if (sd.count("dw")) {
      grads[1] = sd["dw"].toTensor() * go;
      tied_embedding::dense_gradient_given(sd["tied"].toIntVector());
    }
    if (sd.count("db")) grads[2] = sd["db"].toTensor() * go;
    return grads;
  }
};

}  // namespace

at::Tensor fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& bias, const at::Tensor& labels,
                                      int64_t ignore_index, int64_t chunk_rows,
                                      std::optional<at::ScalarType> matmul, int64_t pad_vocab_to) {
  const int64_t pad = pad_multiple(hidden, pad_vocab_to);
  PT_CHECK(hidden.size(-1) == weight.size(1), "fused_linear_cross_entropy: hidden size ",
           hidden.size(-1), " does not match weight ", weight.sizes());
  PT_CHECK(hidden.numel() / hidden.size(-1) == labels.numel(), "fused_linear_cross_entropy: ",
           labels.numel(), " labels for ", hidden.numel() / hidden.size(-1), " rows");
  const at::ScalarType mm = matmul.value_or(matmul_dtype(hidden));
  const int64_t chunk = chunk_rows > 0 ? chunk_rows : default_chunk(weight.size(0), hidden.is_cuda(), mm);
  const bool grad = at::GradMode::is_enabled() &&
                    (hidden.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (grad) {
    return FusedLinearCE::apply(hidden, weight, bias.defined() ? bias : at::empty({0}, weight.options()), labels,
                                ignore_index, chunk, static_cast<int64_t>(mm), pad);
  }
  auto rows = flatten(hidden, labels, ignore_index);
  const auto p = pad_vocab(compute_dtype(weight), bias.defined() ? compute_dtype(bias) : bias, pad);
  auto sum = chunked_loss(rows.h, p.w, p.b, rows.y, rows.weight, chunk, false, false, false, nullptr, mm);
  return finish(sum, rows, hidden.scalar_type());
}

LmHeadOutput masked_lm_head(const at::Tensor& hidden, const at::Tensor& labels,
                            const std::function<at::Tensor(const at::Tensor&)>& transform, const at::Tensor& weight,
                            const at::Tensor& bias, bool sparse, bool fused, const TpSlot* vocab_slot) {
  namespace F = torch::nn::functional;
  const TpSlot plain;
  const TpSlot& vocab = vocab_slot ? *vocab_slot : plain;
  LmHeadOutput out;
  if (!labels.defined()) {
    out.logits = lm_logits(transform(hidden), weight, bias, vocab);
    return out;
  }
  auto h = hidden, y = labels;
  if (sparse) {
    auto flat = labels.reshape({-1});
    auto idx = flat.ne(-100).nonzero().squeeze(1);
    h = h.reshape({-1, h.size(-1)}).index_select(0, idx);
    y = flat.index_select(0, idx);
  }
  if (fused) {
    out.loss = lm_loss(transform(h), weight, bias, y, vocab);
    return out;
  }
  out.logits = lm_logits(transform(h), weight, bias, vocab);
  out.loss = F::cross_entropy(out.logits.reshape({-1, out.logits.size(-1)}), y.reshape({-1}),
                              F::CrossEntropyFuncOptions().ignore_index(-100));
  return out;
}

}  // namespace polytrain
