// BERT / RoBERTa masked-LM: the math of HF's modeling_bert.py / modeling_roberta.py in libtorch.
// Registration names are chosen so named_parameters() equals HF's state_dict keys.
#include "polytrain/models/bert.h"

#include <cmath>
#include <filesystem>

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>

#include "polytrain/common/error.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/hf_layers.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/hf_pretrained.h"

namespace polytrain {

namespace F = torch::nn::functional;

namespace {
bool is_roberta(const ModelConfig& cfg) { return cfg.model_type == "roberta"; }

at::Tensor activation(const std::string& act, const at::Tensor& x) { return hf_activation(act, x); }

torch::nn::LayerNorm layer_norm(const ModelConfig& cfg) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({cfg.hidden_size}).eps(cfg.layer_norm_eps));
}

at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x) { return norm_in_weight_dtype(ln, x); }

}  // namespace

BertEmbeddingsImpl::BertEmbeddingsImpl(const ModelConfig& cfg) {
  word_embeddings = register_module(
      "word_embeddings", Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id));
  position_offset_ = is_roberta(cfg) ? cfg.pad_token_id + 1 : 0;
  position_embeddings = register_module(
      "position_embeddings", torch::nn::Embedding(cfg.max_position_embeddings, cfg.hidden_size));
  token_type_embeddings = register_module(
      "token_type_embeddings", torch::nn::Embedding(cfg.type_vocab_size, cfg.hidden_size));
  LayerNorm = register_module("LayerNorm", layer_norm(cfg));
  dropout = register_module("dropout", Dropout(cfg.hidden_dropout_prob));
}

at::Tensor BertEmbeddingsImpl::forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids) {
  const int64_t len = input_ids.size(1);
  PT_INPUT_CHECK(len + position_offset_ <= position_embeddings->weight.size(0), "sequence length ",
                 len, " exceeds model.max_position_embeddings ",
                 position_embeddings->weight.size(0) - position_offset_);
  at::Tensor positions;
  if (position_offset_ > 0) {
    // RoBERTa: padding tokens keep position padding_idx, the others count from padding_idx + 1.
    const int64_t pad = position_offset_ - 1;
    auto not_pad = input_ids.ne(pad).to(torch::kLong);
    positions = torch::cumsum(not_pad, 1) * not_pad + pad;
  } else {
    positions = torch::arange(len, input_ids.options()).unsqueeze(0);
  }
  auto x = word_embeddings(input_ids) + position_embeddings(positions) +
           token_type_embeddings(token_type_ids);
  return dropout(norm(LayerNorm, x));
}

BertSelfAttentionImpl::BertSelfAttentionImpl(const ModelConfig& cfg)
    : head_dim_(cfg.hidden_size / cfg.num_attention_heads),
      attn_impl_(parse_attn_impl(cfg.attn_implementation, "model.attn_implementation")) {
  query = register_module("query", Linear(cfg.hidden_size, cfg.hidden_size));
  key = register_module("key", Linear(cfg.hidden_size, cfg.hidden_size));
  value = register_module("value", Linear(cfg.hidden_size, cfg.hidden_size));
  dropout = register_module("dropout", Dropout(cfg.attention_probs_dropout_prob));
}

at::Tensor BertSelfAttentionImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask) {
  const int64_t b = x.size(0), l = x.size(1);
  auto split = [&](const at::Tensor& t) { return t.view({b, l, -1, head_dim_}).transpose(1, 2); };
  auto q = split(query(x)), k = split(key(x)), v = split(value(x));
  if (use_sdpa(attn_impl_, q, *dropout)) {
    const double p = dropout->is_training() ? dropout->p : 0.0;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    return sdpa(q, k, v, additive_mask, false, scale, p).transpose(1, 2).contiguous().view({b, l, -1});
  }
  auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(head_dim_));
  if (additive_mask.defined()) scores = scores + additive_mask;
  auto probs = dropout(torch::softmax(scores, -1));
  auto ctx = torch::matmul(probs, v).transpose(1, 2).contiguous();
  return ctx.view({b, l, -1});
}

BertOutputImpl::BertOutputImpl(int64_t in, int64_t out, const ModelConfig& cfg) {
  dense = register_module("dense", Linear(in, out));
  LayerNorm = register_module("LayerNorm", layer_norm(cfg));
  dropout = register_module("dropout", Dropout(cfg.hidden_dropout_prob));
}

at::Tensor BertOutputImpl::forward(const at::Tensor& x, const at::Tensor& residual) {
  return norm(LayerNorm, dropout(dense(x)) + residual);
}

BertAttentionImpl::BertAttentionImpl(const ModelConfig& cfg) {
  self = register_module("self", BertSelfAttention(cfg));
  output = register_module("output", BertOutput(cfg.hidden_size, cfg.hidden_size, cfg));
}

at::Tensor BertAttentionImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask) {
  return output(self(x, additive_mask), x);
}

BertIntermediateImpl::BertIntermediateImpl(const ModelConfig& cfg) : act_(cfg.hidden_act) {
  dense = register_module("dense", Linear(cfg.hidden_size, cfg.intermediate_size));
  check_hf_activation(act_);  // reject an unsupported activation at build time
}

at::Tensor BertIntermediateImpl::forward(const at::Tensor& x) { return activation(act_, dense(x)); }

BertLayerImpl::BertLayerImpl(const ModelConfig& cfg) {
  attention = register_module("attention", BertAttention(cfg));
  intermediate = register_module("intermediate", BertIntermediate(cfg));
  output = register_module("output", BertOutput(cfg.intermediate_size, cfg.hidden_size, cfg));
}

at::Tensor BertLayerImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask) {
  auto a = attention(x, additive_mask);
  return output(intermediate(a), a);
}

BertEncoderImpl::BertEncoderImpl(const ModelConfig& cfg) {
  layer = register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) layer->push_back(BertLayer(cfg));
}

at::Tensor BertEncoderImpl::run_layer(size_t i, const at::Tensor& x, const at::Tensor& additive_mask) {
  auto* l = layer->ptr(i)->as<BertLayer>();
  if (checkpoint_layers && is_training())
    return checkpointed(
        [l, additive_mask](const at::Tensor& h) { return in_layer(*l, [&] { return l->forward(h, additive_mask); }); },
        x);
  return in_layer(*l, [&] { return l->forward(x, additive_mask); });
}

at::Tensor BertEncoderImpl::forward(at::Tensor x, const at::Tensor& additive_mask) {
  for (size_t i = 0; i < layer->size(); ++i) x = run_layer(i, x, additive_mask);
  return x;
}

BertModelImpl::BertModelImpl(const ModelConfig& cfg) {
  embeddings = register_module("embeddings", BertEmbeddings(cfg));
  encoder = register_module("encoder", BertEncoder(cfg));
}

std::pair<at::Tensor, at::Tensor> BertModelImpl::embed(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                                       const at::Tensor& token_type_ids) {
  auto types = token_type_ids.defined() ? token_type_ids : torch::zeros_like(input_ids);
  auto h = embeddings(input_ids, types);
  return {h, extended_attention_mask(attention_mask, h.scalar_type())};
}

at::Tensor BertModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                  const at::Tensor& token_type_ids) {
  auto [h, mask] = embed(input_ids, attention_mask, token_type_ids);
  return encoder(h, mask);
}

BertLMHeadImpl::BertLMHeadImpl(const ModelConfig& cfg, Embedding word_embeddings)
    // HF's RobertaLMHead applies gelu whatever hidden_act says; BERT's head uses hidden_act.
    : decoder_weight_(word_embeddings->weight),
      decoder_(std::move(word_embeddings)),
      act_(is_roberta(cfg) ? "gelu" : cfg.hidden_act) {
  dense = torch::nn::Linear(cfg.hidden_size, cfg.hidden_size);
  LayerNorm = layer_norm(cfg);
  if (is_roberta(cfg)) {
    register_module("dense", dense);
    register_module("layer_norm", LayerNorm);
  } else {
    auto transform = std::make_shared<torch::nn::Module>("transform");
    transform->register_module("dense", dense);
    transform->register_module("LayerNorm", LayerNorm);
    register_module("transform", transform);
  }
  bias = register_parameter("bias", torch::zeros({cfg.vocab_size}));
}

at::Tensor BertLMHeadImpl::transform(const at::Tensor& hidden) {
  return norm(LayerNorm, activation(act_, dense(hidden)));
}

at::Tensor BertLMHeadImpl::forward(const at::Tensor& hidden) {
  return lm_logits(transform(hidden), decoder_weight_, bias, decoder_->tp);
}

BertForMaskedLMImpl::BertForMaskedLMImpl(const ModelConfig& cfg)
    : config_(cfg), score_masked_only_(cfg.sparse_prediction), fused_lm_loss_(cfg.fused_lm_loss) {
  PT_INPUT_CHECK(cfg.model_type == "bert" || cfg.model_type == "roberta", "model.model_type: '",
                 cfg.model_type, "' is not a masked-LM model this class builds (bert, roberta)");
  const bool roberta = is_roberta(cfg);
  encoder_model = register_module(roberta ? "roberta" : "bert", BertModel(cfg));
  lm_head = BertLMHead(cfg, encoder_model->embeddings->word_embeddings);
  if (roberta) {
    register_module("lm_head", lm_head);
  } else {
    auto cls = std::make_shared<torch::nn::Module>("cls");
    cls->register_module("predictions", lm_head);
    register_module("cls", cls);
  }
  init_weights(cfg.initializer_range);
}

void BertForMaskedLMImpl::set_activation_checkpointing(bool on) { encoder_model->encoder->checkpoint_layers = on; }

TpPlan BertForMaskedLMImpl::tensor_parallel_plan() const {
  const std::string base = is_roberta(config_) ? "roberta" : "bert";
  const std::string layer = base + R"(\.encoder\.layer\.\d+\.)";
  TpPlan p;
  p.model = config_.model_type;
  p.layers = {{base + R"(\.embeddings\.word_embeddings)", TpStyle::kVocab},
              {layer + R"(attention\.self\.(query|key|value))", TpStyle::kColumn},
              {layer + R"(attention\.output\.dense)", TpStyle::kRow},
              {layer + R"(intermediate\.dense)", TpStyle::kColumn},
              {layer + R"(output\.dense)", TpStyle::kRow},
              {is_roberta(config_) ? R"(lm_head\.bias)" : R"(cls\.predictions\.bias)", TpStyle::kVocab}};
  p.region_dropouts = {layer + R"(attention\.self\.dropout)"};
  p.divisible = {{"num_attention_heads", config_.num_attention_heads}, {"intermediate_size", config_.intermediate_size}};
  return p;
}

void BertForMaskedLMImpl::init_weights(double std) {
  init_hf_weights(*this, std);
  torch::NoGradGuard no_grad;
  lm_head->bias.zero_();
}

LmHeadOutput BertForMaskedLMImpl::mlm_output(const at::Tensor& hidden, const at::Tensor& labels) {
  return masked_lm_head(
      hidden, labels, [&](const at::Tensor& h) { return lm_head->transform(h); }, lm_head->decoder_weight_,
      lm_head->bias, score_masked_only_, fused_lm_loss_, &lm_head->decoder_->tp);
}

ModelOutput BertForMaskedLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                         const at::Tensor& token_type_ids, const at::Tensor& labels) {
  ModelOutput out;
  out.hidden_states = encoder_model(input_ids, attention_mask, token_type_ids);
  auto head = mlm_output(out.hidden_states, labels);
  out.loss = head.loss;
  out.logits = head.logits;
  return out;
}

PipelinePlan BertForMaskedLMImpl::pipeline_plan() {
  const std::string base = is_roberta(config_) ? "roberta." : "bert.";
  PipelinePlan plan;
  plan.layers.push_back(embeddings_layer(
      "BertEmbeddings", {base + "embeddings."},
      [this](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& types) {
        return encoder_model->embed(ids, mask, types);
      }));
  BertEncoderImpl* encoder = encoder_model->encoder.get();
  for (size_t i = 0; i < encoder->layer->size(); ++i) {
    const std::string n = std::to_string(i);
    plan.layers.push_back(block_layer(
        "layer." + n, "BertLayer", {base + "encoder.layer." + n + "."},
        [encoder, i](const at::Tensor& h, const at::Tensor& mask) { return encoder->run_layer(i, h, mask); }));
  }
  // The decoder is the word embedding matrix: the head reads it too (the pipeline sums its two gradients).
  plan.layers.push_back(loss_head(
      "BertLMHead", {is_roberta(config_) ? "lm_head." : "cls.predictions.", base + "embeddings.word_embeddings.weight"},
      [this](const at::Tensor& hidden, const TensorMap& in) {
        return mlm_output(hidden, plan_input(in, "labels", "head")).loss;
      }));
  return plan;
}

// ---- Hugging Face layout -------------------------------------------------------------------------

void BertForMaskedLMImpl::save_pretrained(const std::string& dir) const {
  ::polytrain::save_pretrained(*this, bert_config_to_json(config_), dir);
}

BertForMaskedLM BertForMaskedLMImpl::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const ModelConfig cfg = bert_config_from_json(read_pretrained_config(dir), config_path);
  PT_INPUT_CHECK(cfg.tie_word_embeddings, config_path,
                 ": 'tie_word_embeddings' false is not supported (the decoder is the word embedding matrix)");
  BertForMaskedLM model(cfg);
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  PT_INPUT_CHECK(fs::exists(path), path, ": not found (HF sharded or .bin checkpoints are not read; ",
                 "convert them to one model.safetensors)");
  const NamedTensors tensors = load_safetensors(path);

  const std::string base = is_roberta(cfg) ? "roberta" : "bert";
  const std::string head = is_roberta(cfg) ? "lm_head" : "cls\\.predictions";
  HfLoadOptions options;
  options.base_prefix = base;
  // What HF's BertForMaskedLM / RobertaForMaskedLM let pass: the pooler, BertForPreTraining's
  // NSP head, position_ids buffers of older versions, the tied decoder copies .bin files carry.
  options.ignore_unused = {"(^|\\.)pooler\\.", "^cls\\.seq_relationship\\.", "(^|\\.)embeddings\\.position_ids$",
                           "(^|\\.)embeddings\\.token_type_ids$", "^" + head + "\\.decoder\\.(weight|bias)$"};
  bool base_checkpoint = true;
  for (const auto& [name, t] : tensors)
    if (name.rfind(base + ".", 0) == 0) base_checkpoint = false;
  if (base_checkpoint) options.optional = {is_roberta(cfg) ? "^lm_head\\." : "^cls\\."};
  load_named_tensors(*model, tensors, options, path);
  return model;
}

}  // namespace polytrain
