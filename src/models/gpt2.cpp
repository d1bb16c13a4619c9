// GPT-2: the math of HF's modeling_gpt2.py (eager attention) in libtorch. Registration names
// are chosen so named_parameters() equals GPT2LMHeadModel's state_dict keys.
#include "polytrain/models/gpt2.h"

#include <cmath>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/hf_config.h"
#include "polytrain/models/hf_layers.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/models/cpu_dropout.h"
#include "polytrain/ops/cpu_ops.h"
#include "polytrain/ops/cuda_ops.h"
#include "polytrain/common/autocast.h"

namespace polytrain {

namespace F = torch::nn::functional;

namespace {

at::Tensor activation(const std::string& act, const at::Tensor& x) {
  return hf_activation(act, x, "model.activation_function");
}

torch::nn::LayerNorm layer_norm(const Gpt2Config& cfg) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd}).eps(cfg.layer_norm_epsilon));
}

at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x) { return norm_in_weight_dtype(ln, x); }

}  // namespace

Gpt2Conv1DImpl::Gpt2Conv1DImpl(int64_t in, int64_t out) {
  weight = register_parameter("weight", torch::empty({in, out}).normal_(0.0, 0.02));
  bias = register_parameter("bias", torch::zeros({out}));
}

at::Tensor Gpt2Conv1DImpl::forward(const at::Tensor& x) {
  auto in = tp_enter(x);
  auto sizes = in.sizes().vec();
  sizes.back() = weight.size(1);
  const auto rows = in.reshape({-1, in.size(-1)});
  if (tp_bias_after()) return tp_leave(torch::mm(rows, weight).view(sizes), bias);
  return tp_leave(torch::addmm(bias, rows, weight).view(sizes), at::Tensor());
}

Gpt2AttentionImpl::Gpt2AttentionImpl(const Gpt2Config& cfg, int64_t layer_idx) : head_dim_(cfg.n_embd / cfg.n_head) {
  c_attn = register_module("c_attn", Gpt2Conv1D(cfg.n_embd, 3 * cfg.n_embd));
  c_proj = register_module("c_proj", Gpt2Conv1D(cfg.n_embd, cfg.n_embd));
  attn_dropout = register_module("attn_dropout", Dropout(cfg.attn_pdrop));
  resid_dropout = register_module("resid_dropout", Dropout(cfg.resid_pdrop));
  attn_impl_ = parse_attn_impl(cfg.attn_implementation, "model.attn_implementation");
  scale_ = 1.0;
  if (cfg.scale_attn_weights) scale_ /= std::sqrt(static_cast<double>(head_dim_));
  if (cfg.scale_attn_by_inverse_layer_idx) scale_ /= static_cast<double>(layer_idx + 1);
}

at::Tensor Gpt2AttentionImpl::forward(const at::Tensor& x, const at::Tensor& masked) {
  const int64_t b = x.size(0), l = x.size(1);
  auto fused = c_attn(x);  // [B, L, 3 x (local heads x head_dim)]
  // The CPU's default under the causal mask alone: the fused causal kernel (the eager math,
  // only the scores a query sees, q, k, v read in place; the same dropout mask), in fp32 also
  // under bf16 autocast (the projection upcast: 4-7% off GPT-2 124M's bf16 step against the
  // eager path's bf16 products, and the attention's math more exact).
  const int64_t local_heads = fused.size(-1) / 3 / head_dim_;
  const bool bf16 = fused.scalar_type() == at::kBFloat16;
  // The upcast only where the kernel is a candidate (on the CPU; not before a padded batch's
  // eager path).
  const bool candidate = attn_impl_ == AttnImpl::kAuto && masked.size(0) == 1 && attn_dropout->p < 1.0 &&
                         !fused.is_cuda() && cpu_ops::enabled();
  const auto f32 = candidate && bf16 ? fused.to(at::kFloat) : fused;
  if (candidate && cpu_ops::causal_attention_handles(f32, local_heads)) {
    const bool drop = attn_dropout->is_training() && attn_dropout->p > 0.0;
    const uint64_t seed = drop ? dropout_seed(attn_dropout->generator ? &*attn_dropout->generator : nullptr) : 0;
    auto ctx = cpu_ops::causal_attention(f32, local_heads, scale_, drop ? attn_dropout->p : 0.0, seed);
    return resid_dropout(c_proj(bf16 ? ctx.to(at::kBFloat16) : ctx));
  }
  auto qkv = fused.split(fused.size(-1) / 3, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({b, l, -1, head_dim_}).transpose(1, 2); };
  auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  if (use_sdpa(attn_impl_, q, *attn_dropout)) {
    // A [1, 1, L, L] mask is GPT2Model's causal mask alone: the kernels' own causal path.
    const bool causal_only = masked.size(0) == 1;
    at::Tensor additive;
    if (!causal_only) additive = torch::zeros(masked.sizes(), q.options().dtype(torch::kFloat)).masked_fill(masked, std::numeric_limits<float>::lowest());
    const double p = attn_dropout->is_training() ? attn_dropout->p : 0.0;
    auto ctx = sdpa(q, k, v, additive, causal_only, scale_, p).transpose(1, 2).reshape({b, l, -1});
    return resid_dropout(c_proj(ctx));
  }
  auto scores = torch::matmul(q, k.transpose(-1, -2));
  if (scale_ != 1.0) scores = scores * scale_;
  // HF: masked scores become finfo.min (a fully masked row, a left-padded query, gets a
  // uniform row instead of NaN); softmax in fp32 under autocast, as autocast's fp32 list has it.
  if (scores.scalar_type() != torch::kFloat && scores.scalar_type() != torch::kDouble) scores = scores.to(torch::kFloat);
  scores = scores.masked_fill(masked, std::numeric_limits<float>::lowest());
  auto probs = attn_dropout(torch::softmax(scores, -1).to(v.scalar_type()));
  auto ctx = torch::matmul(probs, v).transpose(1, 2).reshape({b, l, -1});
  return resid_dropout(c_proj(ctx));
}

Gpt2MlpImpl::Gpt2MlpImpl(const Gpt2Config& cfg) : act_(cfg.activation_function) {
  const int64_t inner = cfg.n_inner > 0 ? cfg.n_inner : 4 * cfg.n_embd;
  c_fc = register_module("c_fc", Gpt2Conv1D(cfg.n_embd, inner));
  c_proj = register_module("c_proj", Gpt2Conv1D(inner, cfg.n_embd));
  dropout = register_module("dropout", Dropout(cfg.resid_pdrop));
}

at::Tensor Gpt2MlpImpl::forward(const at::Tensor& x) { return dropout(c_proj(activation(act_, c_fc(x)))); }

Gpt2BlockImpl::Gpt2BlockImpl(const Gpt2Config& cfg, int64_t layer_idx) {
  ln_1 = register_module("ln_1", layer_norm(cfg));
  attn = register_module("attn", Gpt2Attention(cfg, layer_idx));
  ln_2 = register_module("ln_2", layer_norm(cfg));
  mlp = register_module("mlp", Gpt2Mlp(cfg));
}

at::Tensor Gpt2BlockImpl::forward(const at::Tensor& x, const at::Tensor& masked) {
  auto h = x + attn(norm(ln_1, x).to(x.scalar_type()), masked);
  return h + mlp(norm(ln_2, h).to(h.scalar_type()));
}

Gpt2ModelImpl::Gpt2ModelImpl(const Gpt2Config& cfg) {
  wte = register_module("wte", Embedding(cfg.vocab_size, cfg.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(cfg.n_positions, cfg.n_embd));
  drop = register_module("drop", Dropout(cfg.embd_pdrop));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) h->push_back(Gpt2Block(cfg, i));
  ln_f = register_module("ln_f", layer_norm(cfg));
}

std::pair<at::Tensor, at::Tensor> Gpt2ModelImpl::embed(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  const int64_t len = input_ids.size(1);
  PT_INPUT_CHECK(len <= wpe->weight.size(0), "sequence length ", len, " exceeds model.n_positions ",
                 wpe->weight.size(0));
  auto positions = torch::arange(len, input_ids.options()).unsqueeze(0);
  auto x = drop(wte(input_ids) + wpe(positions));
  // masked[b, 0, i, j]: query i may not see key j (a later position, or padding).
  auto masked = torch::ones({len, len}, input_ids.options().dtype(torch::kBool)).triu(1).view({1, 1, len, len});
  if (attention_mask.defined())
    masked = masked.logical_or(attention_mask.eq(0).view({attention_mask.size(0), 1, 1, len}));
  return {x, masked};
}

at::Tensor Gpt2ModelImpl::run_block(size_t i, const at::Tensor& x, const at::Tensor& masked) {
  auto* block = h->ptr(i)->as<Gpt2Block>();
  auto run = [block, masked](const at::Tensor& t) {
    return in_layer(*block, [&] { return block->forward(t, masked); });
  };
  return checkpoint_blocks && is_training() ? checkpointed(run, x) : run(x);
}

at::Tensor Gpt2ModelImpl::final_norm(const at::Tensor& x) { return norm(ln_f, x); }

at::Tensor Gpt2ModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  auto [x, masked] = embed(input_ids, attention_mask);
  if (x.is_cuda() && x.scalar_type() == torch::kFloat && cuda_ops::available() && x.size(-1) <= 8192 &&
      !(checkpoint_blocks && is_training()) && h->size() > 0 && !has_layer_params(*h->ptr(0)))
    return fused_blocks(x, masked);
  for (size_t i = 0; i < h->size(); ++i) x = run_block(i, x, masked);
  return final_norm(x);
}

at::Tensor Gpt2ModelImpl::fused_blocks(at::Tensor x, const at::Tensor& masked) {
  // The same math as Gpt2Block::forward: x + attn(ln_1(x)), then + mlp(ln_2(.)); each add
  // and the LayerNorm after it (the next block's ln_1, or ln_f) are one kernel. The blocks'
  // LayerNorm outputs come out in the autocast dtype their GEMMs would cast them to; ln_f's in
  // fp32, as norm() returns it.
  const auto inner = autocast_type(x.device().type()).value_or(x.scalar_type());
  std::vector<Gpt2BlockImpl*> blocks;
  for (const auto& m : *h) blocks.push_back(m->as<Gpt2BlockImpl>());
  auto a = norm(blocks[0]->ln_1, x).to(inner);
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto* b = blocks[i];
    auto attn_out = b->attn(a, masked);
    auto [h1, m_in] = cuda_ops::add_layer_norm(x, attn_out, b->ln_2->weight, b->ln_2->bias, b->ln_2->options.eps(), inner);
    auto mlp_out = b->mlp(m_in);
    const bool last = i + 1 == blocks.size();
    auto& next = last ? ln_f : blocks[i + 1]->ln_1;
    auto [h2, n_in] = cuda_ops::add_layer_norm(h1, mlp_out, next->weight, next->bias, next->options.eps(),
                                               last ? torch::kFloat : inner);
    x = h2;
    a = n_in;
  }
  return a;
}

Gpt2LMHeadModelImpl::Gpt2LMHeadModelImpl(const Gpt2Config& cfg) : config_(cfg) {
  transformer = register_module("transformer", Gpt2Model(cfg));
  if (!cfg.tie_word_embeddings) lm_head = register_module("lm_head", Linear(cfg.n_embd, cfg.vocab_size, false));
  init_weights();
}

at::Tensor Gpt2LMHeadModelImpl::lm_head_weight() const {
  return config_.tie_word_embeddings ? transformer->wte->weight : lm_head->weight;
}

const TpSlot& Gpt2LMHeadModelImpl::lm_head_slot() const {
  return config_.tie_word_embeddings ? transformer->wte->tp : lm_head->tp;
}

TpPlan Gpt2LMHeadModelImpl::tensor_parallel_plan() const {
  TpPlan p;
  p.model = "gpt2";
  p.layers = {{R"(transformer\.wte)", TpStyle::kVocab},
              {R"(transformer\.h\.\d+\.attn\.c_attn)", TpStyle::kColumn, /*blocks=*/3},
              {R"(transformer\.h\.\d+\.attn\.c_proj)", TpStyle::kRow},
              {R"(transformer\.h\.\d+\.mlp\.c_fc)", TpStyle::kColumn},
              {R"(transformer\.h\.\d+\.mlp\.c_proj)", TpStyle::kRow}};
  if (!config_.tie_word_embeddings) p.layers.push_back({"lm_head", TpStyle::kVocab});
  p.region_dropouts = {R"(transformer\.h\.\d+\.attn\.attn_dropout)"};
  p.divisible = {{"n_head", config_.n_head},
                 {"n_inner", config_.n_inner > 0 ? config_.n_inner : 4 * config_.n_embd}};
  return p;
}

void Gpt2LMHeadModelImpl::set_activation_checkpointing(bool on) { transformer->checkpoint_blocks = on; }

void Gpt2LMHeadModelImpl::init_weights() {
  torch::NoGradGuard no_grad;
  const double std = config_.initializer_range;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    auto& p = item.value();
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (name.find("ln_") != std::string::npos) {
      is_bias ? p.zero_() : p.fill_(1.0);
    } else if (is_bias) {
      p.zero_();
    } else if (name.find("c_proj.weight") != std::string::npos) {
      // GPT-2 paper: residual projections scaled by 1/sqrt(N) at init (N = 2 per block).
      p.normal_(0.0, std / std::sqrt(2.0 * static_cast<double>(config_.n_layer)));
    } else {
      p.normal_(0.0, std);
    }
  }
}

ModelOutput Gpt2LMHeadModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                         const at::Tensor& labels) {
  return lm_output(transformer(input_ids, attention_mask), labels);
}

ModelOutput Gpt2LMHeadModelImpl::lm_output(const at::Tensor& hidden, const at::Tensor& labels) {
  ModelOutput out;
  out.hidden_states = hidden;
  const at::Tensor w = lm_head_weight();
  if (labels.defined()) {
    // Token t predicts labels[t + 1] (HF shifts inside the model).
    const int64_t l = out.hidden_states.size(1);
    auto h = out.hidden_states.narrow(1, 0, l - 1);
    auto y = labels.narrow(1, 1, l - 1);
    if (config_.fused_lm_loss) {
      out.loss = lm_loss(h, w, at::Tensor(), y, lm_head_slot());
      return out;
    }
    out.logits = lm_logits(out.hidden_states, w, at::Tensor(), lm_head_slot());
    auto shifted = out.logits.narrow(1, 0, l - 1);
    out.loss = F::cross_entropy(shifted.reshape({-1, shifted.size(-1)}), y.reshape({-1}),
                                F::CrossEntropyFuncOptions().ignore_index(-100));
    return out;
  }
  out.logits = lm_logits(out.hidden_states, w, at::Tensor(), lm_head_slot());
  return out;
}

PipelinePlan Gpt2LMHeadModelImpl::pipeline_plan() {
  PipelinePlan plan;
  plan.layers.push_back(embeddings_layer(
      "Gpt2Embeddings", {"transformer.wte.", "transformer.wpe."},
      [this](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& /*token_type_ids*/) {
        return transformer->embed(ids, mask);
      }));
  Gpt2ModelImpl* model = transformer.get();
  for (size_t i = 0; i < model->h->size(); ++i) {
    const std::string n = std::to_string(i);
    plan.layers.push_back(block_layer(
        "h." + n, "Gpt2Block", {"transformer.h." + n + "."},
        [model, i](const at::Tensor& x, const at::Tensor& masked) { return model->run_block(i, x, masked); }));
  }
  const std::string head = config_.tie_word_embeddings ? "transformer.wte.weight" : "lm_head.";
  plan.layers.push_back(
      loss_head("Gpt2LMHead", {"transformer.ln_f.", head}, [this](const at::Tensor& hidden, const TensorMap& in) {
        return lm_output(transformer->final_norm(hidden), plan_input(in, "labels", "head")).loss;
      }));
  return plan;
}

void Gpt2LMHeadModelImpl::save_pretrained(const std::string& dir) const {
  polytrain::save_pretrained(*this, gpt2_config_to_json(config_), dir);
}

std::shared_ptr<Gpt2LMHeadModelImpl> Gpt2LMHeadModelImpl::from_pretrained(const std::string& dir) {
  auto config = read_pretrained_config(dir);
  auto model = std::make_shared<Gpt2LMHeadModelImpl>(gpt2_config_from_json(config, dir + "/config.json"));
  HfLoadOptions opt;
  opt.base_prefix = "transformer";
  // Old checkpoints carry the causal-mask buffers; tied checkpoints may carry lm_head.weight.
  opt.ignore_unused = {R"(\.attn\.(masked_)?bias$)"};
  if (model->config_.tie_word_embeddings) opt.ignore_unused.push_back(R"(^lm_head\.weight$)");
  load_pretrained_weights(*model, dir, opt);
  return model;
}

}  // namespace polytrain
