// T5: the math of HF's modeling_t5.py (T5LayerNorm, bucketed relative position bias computed by
// block 0 and shared, unscaled attention, dense/gated FF, tied-head rescaling) in libtorch, and
// HF-layout save/load through models/hf_pretrained.h. Config parsing is in t5_config.cpp.
#include "polytrain/models/t5.h"

#include <cmath>
#include <filesystem>
#include <limits>

#include <torch/nn/functional/loss.h>
#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/error.h"
#include "polytrain/models/hf_layers.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/ops/cuda_ops.h"
#include "polytrain/checkpoint/safetensors.h"

namespace polytrain {

namespace F = torch::nn::functional;

namespace {

at::Tensor activation(const std::string& act, const at::Tensor& x) {
  return hf_activation(act, x, "model.feed_forward_proj");
}

// torch.finfo(dtype).min: HF's "masked" value, added to the scores (not -inf: a fully padded row
// stays finite).
double finfo_min(c10::ScalarType t) {
  switch (t) {
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kHalf: return -65504.0;
    case at::kBFloat16: return -3.3895313892515355e38;
    default: return std::numeric_limits<float>::lowest();
  }
}

// HF T5Block clamps fp16 activations that overflowed (inf) back into range.
at::Tensor clamp_fp16(const at::Tensor& x) {
  if (x.scalar_type() != at::kHalf) return x;
  const double max = 65504.0;
  auto bound = torch::where(torch::isinf(x).any(), torch::full({}, max - 1000, x.options()),
                            torch::full({}, max, x.options()));
  return torch::clamp(x, -bound, bound);
}

// Mesh TensorFlow's bucketing of key - query offsets: half the buckets for exact small offsets,
// the rest log-spaced up to max_distance; bidirectional splits them by sign (encoder), the
// decoder only sees the past. Same float32 operations as HF, so the same buckets.
at::Tensor relative_position_bucket(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                    int64_t max_distance) {
  at::Tensor buckets = torch::zeros_like(relative_position);
  at::Tensor pos;
  if (bidirectional) {
    num_buckets /= 2;
    buckets = buckets + (relative_position > 0).to(at::kLong) * num_buckets;
    pos = torch::abs(relative_position);
  } else {
    pos = -torch::min(relative_position, torch::zeros_like(relative_position));
  }
  const int64_t max_exact = num_buckets / 2;
  auto is_small = pos < max_exact;
  auto large = max_exact + (torch::log(pos.to(at::kFloat) / static_cast<double>(max_exact)) /
                            std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                            static_cast<double>(num_buckets - max_exact))
                               .to(at::kLong);
  large = torch::min(large, torch::full_like(large, num_buckets - 1));
  return buckets + torch::where(is_small, pos, large);
}

Linear linear(int64_t in, int64_t out) { return Linear(in, out, /*with_bias=*/false); }

}  // namespace

T5LayerNormImpl::T5LayerNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

at::Tensor T5LayerNormImpl::forward(const at::Tensor& x) {
  if (x.is_cuda() && weight.scalar_type() == at::kFloat && cuda_ops::available() && x.size(-1) <= 8192) {
    // One kernel each way (ops/cuda_ops.h), the same dtypes as the formula below gives.
    const auto ac = autocast_type(x.device().type());
    return cuda_ops::rms_norm(x, weight, eps_, ac ? (feeds_gemms ? *ac : at::kFloat) : x.scalar_type());
  }
  auto variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  auto h = x * torch::rsqrt(variance + eps_);
  if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16) h = h.to(weight.scalar_type());
  // An fp32 norm in a model cast to half (amp O2): the result in the activations' type.
  else if (x.scalar_type() != h.scalar_type() && !autocast_type(x.device().type())) return (weight * h).to(x.scalar_type());
  return weight * h;
}

T5AttentionImpl::T5AttentionImpl(const T5Config& cfg, bool has_relative_attention_bias, bool bidirectional)
    : d_kv_(cfg.d_kv),
      num_buckets_(cfg.relative_attention_num_buckets),
      max_distance_(cfg.relative_attention_max_distance),
      bidirectional_(bidirectional),
      dropout_(cfg.dropout_rate) {
  const int64_t inner = cfg.num_heads * cfg.d_kv;
  q = register_module("q", linear(cfg.d_model, inner));
  k = register_module("k", linear(cfg.d_model, inner));
  v = register_module("v", linear(cfg.d_model, inner));
  o = register_module("o", linear(inner, cfg.d_model));
  if (has_relative_attention_bias)
    relative_attention_bias =
        register_module("relative_attention_bias", Embedding(num_buckets_, cfg.num_heads));
  attn_dropout = register_module("attn_dropout", Dropout(cfg.dropout_rate));
  attn_impl_ = parse_attn_impl(cfg.attn_implementation, "model.attn_implementation");
}

at::Tensor T5AttentionImpl::compute_bias(int64_t query_length, int64_t key_length) const {
  const auto opts = torch::TensorOptions().dtype(at::kLong).device(relative_attention_bias->weight.device());
  auto context = torch::arange(query_length, opts).unsqueeze(1);
  auto memory = torch::arange(key_length, opts).unsqueeze(0);
  auto buckets = relative_position_bucket(memory - context, bidirectional_, num_buckets_, max_distance_);
  auto values = torch::embedding(relative_attention_bias->weight, buckets);  // [Lq, Lk, H]
  return values.permute({2, 0, 1}).unsqueeze(0);
}

at::Tensor T5AttentionImpl::forward(const at::Tensor& x, const at::Tensor& kv, const at::Tensor& bias) {
  const int64_t b = x.size(0);
  const int64_t heads = q->weight.size(0) / d_kv_;  // this rank's heads
  auto split = [&](const at::Tensor& t) { return t.view({b, -1, heads, d_kv_}).transpose(1, 2); };
  auto qs = split(q(x)), ks = split(k(kv)), vs = split(v(kv));
  if (use_sdpa(attn_impl_, qs, *attn_dropout)) {  // scale 1: T5 folds 1/sqrt(d_kv) into q's init
    const double p = attn_dropout->is_training() ? attn_dropout->p : 0.0;
    return o(sdpa(qs, ks, vs, bias, false, 1.0, p).transpose(1, 2).contiguous().view({b, -1, heads * d_kv_}));
  }
  auto scores = torch::matmul(qs, ks.transpose(3, 2));  // no 1/sqrt(d_kv): T5 folds it into q's init
  // HF adds in place, keeping the scores' dtype under autocast.
  if (bias.defined()) scores = (scores + bias).to(scores.scalar_type());
  auto weights = torch::softmax(scores.to(at::kFloat), -1).to(scores.scalar_type());
  weights = attn_dropout(weights);
  auto out = torch::matmul(weights, vs).transpose(1, 2).contiguous().view({b, -1, heads * d_kv_});
  return o(out);
}

T5LayerAttentionImpl::T5LayerAttentionImpl(const T5Config& cfg, bool cross, bool has_relative_attention_bias,
                                           bool bidirectional)
    : cross_(cross) {
  attention = register_module(cross ? "EncDecAttention" : "SelfAttention",
                              T5Attention(cfg, has_relative_attention_bias, bidirectional));
  layer_norm = register_module("layer_norm", T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon));
  layer_norm->feeds_gemms = true;
  dropout = register_module("dropout", Dropout(cfg.dropout_rate));
}

at::Tensor T5LayerAttentionImpl::forward(const at::Tensor& x, const at::Tensor& kv, const at::Tensor& bias) {
  auto normed = layer_norm(x);
  return x + dropout(attention(normed, cross_ ? kv : normed, bias));
}

T5LayerFFImpl::T5LayerFFImpl(const T5Config& cfg) : act_(cfg.dense_act_fn()), gated_(cfg.is_gated_act()) {
  dense = std::make_shared<torch::nn::Module>("T5DenseActDense");
  if (gated_) {
    wi_0 = dense->register_module("wi_0", linear(cfg.d_model, cfg.d_ff));
    wi_1 = dense->register_module("wi_1", linear(cfg.d_model, cfg.d_ff));
  } else {
    wi = dense->register_module("wi", linear(cfg.d_model, cfg.d_ff));
  }
  wo = dense->register_module("wo", linear(cfg.d_ff, cfg.d_model));
  act_dropout = dense->register_module("dropout", Dropout(cfg.dropout_rate));
  register_module("DenseReluDense", dense);
  layer_norm = register_module("layer_norm", T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon));
  layer_norm->feeds_gemms = true;
  dropout = register_module("dropout", Dropout(cfg.dropout_rate));
  check_hf_activation(act_, "model.feed_forward_proj");  // fails at build time, not mid-run
}

at::Tensor T5LayerFFImpl::forward(const at::Tensor& x) {
  auto h = layer_norm(x);
  h = gated_ ? activation(act_, wi_0(h)) * wi_1(h) : activation(act_, wi(h));
  h = act_dropout(h);
  // HF keeps wo in fp32 when the rest is half (_keep_in_fp32_modules) and feeds it in wo's dtype.
  if (h.scalar_type() != wo->weight.scalar_type()) h = h.to(wo->weight.scalar_type());
  return x + dropout(wo(h));
}

T5BlockImpl::T5BlockImpl(const T5Config& cfg, bool is_decoder, bool has_relative_attention_bias) {
  layer = register_module("layer", torch::nn::ModuleList());
  self_attention = T5LayerAttention(cfg, /*cross=*/false, has_relative_attention_bias, /*bidirectional=*/!is_decoder);
  layer->push_back(self_attention);
  if (is_decoder) {
    cross_attention = T5LayerAttention(cfg, /*cross=*/true, false, false);
    layer->push_back(cross_attention);
  }
  ff = T5LayerFF(cfg);
  layer->push_back(ff);
}

at::Tensor T5BlockImpl::forward(const at::Tensor& x, const at::Tensor& self_bias, const at::Tensor& enc,
                                const at::Tensor& enc_bias) {
  auto h = clamp_fp16(self_attention(x, x, self_bias));
  if (cross_attention) h = clamp_fp16(cross_attention(h, enc, enc_bias));
  return clamp_fp16(ff(h));
}

T5StackImpl::T5StackImpl(const T5Config& cfg, bool is_decoder) : is_decoder_(is_decoder) {
  block = register_module("block", torch::nn::ModuleList());
  const int64_t n = is_decoder ? cfg.decoder_layers() : cfg.num_layers;
  for (int64_t i = 0; i < n; ++i) block->push_back(T5Block(cfg, is_decoder, /*has_relative_attention_bias=*/i == 0));
  final_layer_norm = register_module("final_layer_norm", T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon));
  dropout = register_module("dropout", Dropout(cfg.dropout_rate));
}

at::Tensor T5StackImpl::position_bias(int64_t len, const at::Tensor& self_mask) {
  auto* first = block->ptr<T5BlockImpl>(0)->self_attention->attention.get();
  at::Tensor bias = in_layer(*block->ptr(0), [&] { return first->compute_bias(len, len); });
  return self_mask.defined() ? bias + self_mask : bias;
}

at::Tensor T5StackImpl::run_block(size_t i, const at::Tensor& x, const at::Tensor& self_bias, const at::Tensor& enc,
                                  const at::Tensor& enc_mask) {
  auto* blk = block->ptr(i)->as<T5BlockImpl>();
  // Each block reads the encoder output through its own view, so the gradients of its k and v
  // projections are summed inside the block before joining the other blocks' - the order a
  // checkpointed block produces them in, which keeps checkpointed gradients bit-identical.
  const at::Tensor enc_view = enc.defined() ? enc.view_as(enc) : enc;
  if (checkpoint_blocks && is_training()) {
    return checkpointed(
        [blk, enc_mask](const std::vector<at::Tensor>& in) {
          return in_layer(*blk, [&] { return blk->forward(in[0], in[1], in[2], enc_mask); });
        },
        {x, self_bias, enc_view});
  }
  return in_layer(*blk, [&] { return blk->forward(x, self_bias, enc_view, enc_mask); });
}

at::Tensor T5StackImpl::final_norm(const at::Tensor& x) { return dropout(final_layer_norm(x)); }

at::Tensor T5StackImpl::forward(const at::Tensor& embeds, const at::Tensor& self_mask, const at::Tensor& enc,
                                const at::Tensor& enc_mask) {
  at::Tensor x = dropout(embeds);
  // HF's block 0 computes bias + mask and hands the sum to every later block; computing it here,
  // before the blocks, is the same tensor and keeps it one input of each checkpointed block.
  const at::Tensor self_bias = position_bias(embeds.size(1), self_mask);
  for (size_t i = 0; i < block->size(); ++i) x = run_block(i, x, self_bias, enc, enc_mask);
  return final_norm(x);
}

T5ForConditionalGenerationImpl::T5ForConditionalGenerationImpl(const T5Config& cfg) : config_(cfg) {
  PT_INPUT_CHECK(cfg.vocab_size > 0 && cfg.d_model > 0 && cfg.d_kv > 0 && cfg.d_ff > 0 && cfg.num_layers > 0 &&
                     cfg.decoder_layers() > 0 && cfg.num_heads > 0,
                 "model: T5 sizes (vocab_size, d_model, d_kv, d_ff, num_layers, num_decoder_layers, num_heads) "
                 "must be > 0");
  shared = register_module("shared", Embedding(cfg.vocab_size, cfg.d_model));
  encoder = register_module("encoder", T5Stack(cfg, /*is_decoder=*/false));
  decoder = register_module("decoder", T5Stack(cfg, /*is_decoder=*/true));
  if (!cfg.tie_word_embeddings) lm_head = register_module("lm_head", linear(cfg.d_model, cfg.vocab_size));
  init_weights();
}

void T5ForConditionalGenerationImpl::init_weights() {
  torch::NoGradGuard no_grad;
  const double f = config_.initializer_factor;
  const double d_model = static_cast<double>(config_.d_model), d_ff = static_cast<double>(config_.d_ff);
  const double inner = static_cast<double>(config_.num_heads * config_.d_kv);
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* ln = m->as<T5LayerNormImpl>()) {
      ln->weight.fill_(f);
    } else if (auto* a = m->as<T5AttentionImpl>()) {
      // Mesh TensorFlow: q's init absorbs the 1/sqrt(d_kv) other transformers apply to the scores.
      a->q->weight.normal_(0.0, f * std::pow(d_model * static_cast<double>(config_.d_kv), -0.5));
      a->k->weight.normal_(0.0, f * std::pow(d_model, -0.5));
      a->v->weight.normal_(0.0, f * std::pow(d_model, -0.5));
      a->o->weight.normal_(0.0, f * std::pow(inner, -0.5));
      if (a->relative_attention_bias) a->relative_attention_bias->weight.normal_(0.0, f * std::pow(d_model, -0.5));
    } else if (auto* ff = m->as<T5LayerFFImpl>()) {
      for (auto* w : {&ff->wi, &ff->wi_0, &ff->wi_1})
        if (*w) (*w)->weight.normal_(0.0, f * std::pow(d_model, -0.5));
      ff->wo->weight.normal_(0.0, f * std::pow(d_ff, -0.5));
    }
  }
  shared->weight.normal_(0.0, f);
  if (lm_head) lm_head->weight.normal_(0.0, f);
}

TpPlan T5ForConditionalGenerationImpl::tensor_parallel_plan() const {
  const std::string block = R"((encoder|decoder)\.block\.\d+\.layer\.\d+\.)";
  const std::string attn = block + R"((SelfAttention|EncDecAttention)\.)";
  TpPlan p;
  p.model = "t5";
  p.layers = {{"shared", TpStyle::kVocab},
              {attn + "(q|k|v)", TpStyle::kColumn},
              {attn + "o", TpStyle::kRow},
              {attn + "relative_attention_bias", TpStyle::kHeads},
              {block + R"(DenseReluDense\.(wi|wi_0|wi_1))", TpStyle::kColumn},
              {block + R"(DenseReluDense\.wo)", TpStyle::kRow}};
  if (!config_.tie_word_embeddings) p.layers.push_back({"lm_head", TpStyle::kVocab});
  p.region_dropouts = {attn + "attn_dropout", block + R"(DenseReluDense\.dropout)"};
  p.divisible = {{"num_heads", config_.num_heads}, {"d_ff", config_.d_ff}};
  return p;
}

void T5ForConditionalGenerationImpl::set_activation_checkpointing(bool on) {
  encoder->checkpoint_blocks = on;
  decoder->checkpoint_blocks = on;
}

at::Tensor T5ForConditionalGenerationImpl::shift_right(const at::Tensor& labels) const {
  auto shifted = torch::zeros_like(labels);
  shifted.slice(1, 1).copy_(labels.slice(1, 0, -1));
  shifted.select(1, 0).fill_(config_.decoder_start_token_id);
  return shifted.masked_fill_(shifted == -100, config_.pad_token_id);
}

at::Tensor T5ForConditionalGenerationImpl::decoder_ids(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                                       const at::Tensor& labels,
                                                       const at::Tensor& decoder_input_ids) const {
  PT_INPUT_CHECK(input_ids.defined() && input_ids.dim() == 2, "T5 forward: input_ids must be [batch, length]");
  PT_INPUT_CHECK(!attention_mask.defined() || attention_mask.sizes() == input_ids.sizes(),
                 "T5 forward: attention_mask must have input_ids' shape");
  PT_INPUT_CHECK(labels.defined() || decoder_input_ids.defined(), "T5 forward: needs labels or decoder_input_ids");
  PT_INPUT_CHECK(!labels.defined() || (labels.dim() == 2 && labels.size(0) == input_ids.size(0)),
                 "T5 forward: labels must be [batch, target length]");
  const at::Tensor dec_ids = decoder_input_ids.defined() ? decoder_input_ids : shift_right(labels);
  PT_INPUT_CHECK(dec_ids.dim() == 2 && dec_ids.size(0) == input_ids.size(0),
                 "T5 forward: decoder_input_ids must be [batch, target length]");
  return dec_ids;
}

at::Tensor T5ForConditionalGenerationImpl::encoder_mask(const at::Tensor& attention_mask, c10::ScalarType dtype) const {
  if (!attention_mask.defined()) return {};
  return (1.0 - attention_mask.to(dtype).unsqueeze(1).unsqueeze(1)) * finfo_min(dtype);
}

at::Tensor T5ForConditionalGenerationImpl::causal_mask(const at::Tensor& embeds) const {
  const int64_t t = embeds.size(1);
  return torch::full({t, t}, finfo_min(embeds.scalar_type()), embeds.options()).triu(1).view({1, 1, t, t});
}

ModelOutput T5ForConditionalGenerationImpl::lm_output(const at::Tensor& hidden, const at::Tensor& labels) {
  ModelOutput out;
  out.hidden_states = hidden;
  if (config_.tie_word_embeddings) {
    // Mesh TensorFlow rescales before the tied projection.
    auto seq = out.hidden_states * std::pow(static_cast<double>(config_.d_model), -0.5);
    out.logits = lm_logits(seq, shared->weight, at::Tensor(), shared->tp);
  } else {
    out.logits = lm_logits(out.hidden_states, lm_head->weight, at::Tensor(), lm_head->tp);
  }
  if (labels.defined()) {
    out.loss = F::cross_entropy(out.logits.reshape({-1, out.logits.size(-1)}), labels.reshape({-1}),
                                F::CrossEntropyFuncOptions().ignore_index(-100));
  }
  return out;
}

ModelOutput T5ForConditionalGenerationImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                                    const at::Tensor& labels, const at::Tensor& decoder_input_ids) {
  const at::Tensor dec_ids = decoder_ids(input_ids, attention_mask, labels, decoder_input_ids);
  const at::Tensor enc_embeds = shared(input_ids);
  const at::Tensor enc_mask = encoder_mask(attention_mask, enc_embeds.scalar_type());
  const at::Tensor enc_out = encoder(enc_embeds, enc_mask);
  const at::Tensor dec_embeds = shared(dec_ids);
  return lm_output(decoder(dec_embeds, causal_mask(dec_embeds), enc_out, enc_mask), labels);
}

PipelinePlan T5ForConditionalGenerationImpl::pipeline_plan() {
  // The carry: "hidden" (the current stack's hidden states), "enc_mask" (the padding mask, from
  // the encoder's embeddings to the last decoder block), "position_bias" (from a stack's block 0
  // to its last block), "self_mask" (the decoder's causal mask, until its block 0 adds it to the
  // bias), "encoder_out" (from the encoder's final norm to the last decoder block).
  PipelinePlan plan;
  plan.layers.push_back(
      {"encoder.embeddings", "T5Embedding", {"shared."}, [this](const TensorMap& in, TensorMap& carry) {
         const at::Tensor& ids = plan_input(in, "input_ids", "encoder.embeddings");
         const at::Tensor mask = plan_optional(in, "attention_mask");
         // forward's input checks, before any work
         decoder_ids(ids, mask, plan_optional(in, "labels"), plan_optional(in, "decoder_input_ids"));
         const at::Tensor embeds = shared(ids);
         carry["hidden"] = encoder->dropout(embeds);
         plan_put(carry, "enc_mask", encoder_mask(mask, embeds.scalar_type()));
       }});
  auto add_blocks = [&](T5StackImpl* stack, const std::string& name, bool decoder_stack) {
    const size_t n = stack->block->size();
    for (size_t i = 0; i < n; ++i) {
      const std::string layer = name + ".block." + std::to_string(i);
      plan.layers.push_back(
          {layer, "T5Block", {layer + "."}, [stack, i, n, decoder_stack](const TensorMap&, TensorMap& carry) {
             const at::Tensor hidden = carry.at("hidden");
             if (i == 0) {
               // The encoder's self-attention mask is its padding mask; the decoder's is causal.
               const at::Tensor self_mask = plan_optional(carry, decoder_stack ? "self_mask" : "enc_mask");
               carry["position_bias"] = stack->position_bias(hidden.size(1), self_mask);
               carry.erase("self_mask");
             }
             const at::Tensor enc = decoder_stack ? carry.at("encoder_out") : at::Tensor();
             const at::Tensor enc_mask = decoder_stack ? plan_optional(carry, "enc_mask") : at::Tensor();
             carry["hidden"] = stack->run_block(i, hidden, carry.at("position_bias"), enc, enc_mask);
             if (i + 1 == n) {
               carry.erase("position_bias");
               if (decoder_stack) {
                 carry.erase("encoder_out");
                 carry.erase("enc_mask");
               }
             }
           }});
    }
  };
  add_blocks(encoder.get(), "encoder", false);
  plan.layers.push_back({"encoder.final_layer_norm", "T5LayerNorm", {"encoder.final_layer_norm."},
                         [this](const TensorMap&, TensorMap& carry) {
                           carry["encoder_out"] = encoder->final_norm(carry.at("hidden"));
                           carry.erase("hidden");
                         }});
  plan.layers.push_back(
      {"decoder.embeddings", "T5Embedding", {"shared."}, [this](const TensorMap& in, TensorMap& carry) {
         const at::Tensor embeds = shared(decoder_ids(plan_input(in, "input_ids", "decoder.embeddings"),
                                                      plan_optional(in, "attention_mask"), plan_optional(in, "labels"),
                                                      plan_optional(in, "decoder_input_ids")));
         carry["hidden"] = decoder->dropout(embeds);
         carry["self_mask"] = causal_mask(embeds);
       }});
  add_blocks(decoder.get(), "decoder", true);
  const std::string head = config_.tie_word_embeddings ? "shared." : "lm_head.";
  plan.layers.push_back(
      loss_head("T5LMHead", {"decoder.final_layer_norm.", head}, [this](const at::Tensor& hidden, const TensorMap& in) {
        return lm_output(decoder->final_norm(hidden), plan_input(in, "labels", "head")).loss;
      }));
  return plan;
}

void T5ForConditionalGenerationImpl::save_pretrained(const std::string& dir) const {
  ::polytrain::save_pretrained(*this, t5_config_to_json(config_), dir);
}

T5ForConditionalGeneration T5ForConditionalGenerationImpl::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const nlohmann::json j = read_pretrained_config(dir);
  const std::string config_path = (fs::path(dir) / "config.json").string();
  PT_INPUT_CHECK(j.is_object(), config_path, ": must be a JSON object");
  if (j.contains("model_type") && j["model_type"].is_string()) {
    const auto type = j["model_type"].get<std::string>();
    PT_INPUT_CHECK(type == "t5" || type == "mt5", config_path, ": 'model_type' is '", type,
                   "', not a T5 model (t5, mt5)");
  }
  T5ForConditionalGeneration model(t5_config_from_json(j, config_path));

  const std::string path = (fs::path(dir) / "model.safetensors").string();
  PT_INPUT_CHECK(fs::exists(path), path, ": not found (HF sharded or .bin checkpoints are not read; ",
                 "convert them to one model.safetensors)");
  NamedTensors tensors = load_safetensors(path);
  // The embedding matrix is tied three ways in HF; a file may carry it under any of its names.
  bool has_shared = false;
  for (const auto& [name, t] : tensors) has_shared = has_shared || name == "shared.weight";
  if (!has_shared)
    for (const auto& [name, t] : tensors)
      if (name == "encoder.embed_tokens.weight" || name == "decoder.embed_tokens.weight") {
        tensors.emplace_back("shared.weight", t);
        break;
      }
  HfLoadOptions options;
  options.ignore_unused = {"^(encoder|decoder)\\.embed_tokens\\.weight$",
                           // HF's _keys_to_ignore_on_load_unexpected: an old export's unused bias
                           "^decoder\\.block\\.0\\.layer\\.1\\.EncDecAttention\\.relative_attention_bias\\.weight$"};
  if (model->config_.tie_word_embeddings) options.ignore_unused.push_back("^lm_head\\.weight$");
  load_named_tensors(*model, tensors, options, path);
  return model;
}

}  // namespace polytrain
