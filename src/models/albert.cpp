// ALBERT: AlbertConfig <-> HF config.json, the math of HF's modeling_albert.py (eval and train),
// and the name rules for loading HF checkpoints. Registration names equal HF's state_dict keys.
#include "polytrain/models/albert.h"

#include <cmath>
#include <filesystem>

#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/linear.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/hf_config.h"
#include "polytrain/models/hf_layers.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/hf_pretrained.h"

namespace polytrain {

namespace F = torch::nn::functional;
using nlohmann::json;

namespace {

at::Tensor activation(const std::string& a, const at::Tensor& x) { return hf_activation(a, x); }

torch::nn::LayerNorm layer_norm(int64_t size, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({size}).eps(eps));
}

at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x) { return norm_in_weight_dtype(ln, x); }

}  // namespace

// ---- modules -------------------------------------------------------------------------------------

AlbertEmbeddingsImpl::AlbertEmbeddingsImpl(const AlbertConfig& cfg) {
  word_embeddings = register_module(
      "word_embeddings",
      torch::nn::Embedding(torch::nn::EmbeddingOptions(cfg.vocab_size, cfg.embedding_size).padding_idx(cfg.pad_token_id)));
  position_embeddings =
      register_module("position_embeddings", torch::nn::Embedding(cfg.max_position_embeddings, cfg.embedding_size));
  token_type_embeddings =
      register_module("token_type_embeddings", torch::nn::Embedding(cfg.type_vocab_size, cfg.embedding_size));
  LayerNorm = register_module("LayerNorm", layer_norm(cfg.embedding_size, cfg.layer_norm_eps));
  dropout = register_module("dropout", Dropout(cfg.hidden_dropout_prob));
}

at::Tensor AlbertEmbeddingsImpl::forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids) {
  const int64_t len = input_ids.size(1), max_len = position_embeddings->weight.size(0);
  PT_INPUT_CHECK(len <= max_len, "sequence length ", len, " exceeds model.max_position_embeddings ", max_len);
  auto positions = torch::arange(len, input_ids.options().dtype(torch::kLong)).unsqueeze(0);
  auto x = word_embeddings(input_ids) + token_type_embeddings(token_type_ids) + position_embeddings(positions);
  return dropout(norm(LayerNorm, x));
}

AlbertAttentionImpl::AlbertAttentionImpl(const AlbertConfig& cfg)
    : heads_(cfg.num_attention_heads), head_dim_(cfg.hidden_size / cfg.num_attention_heads) {
  query = register_module("query", torch::nn::Linear(cfg.hidden_size, cfg.hidden_size));
  key = register_module("key", torch::nn::Linear(cfg.hidden_size, cfg.hidden_size));
  value = register_module("value", torch::nn::Linear(cfg.hidden_size, cfg.hidden_size));
  attention_dropout = register_module("attention_dropout", Dropout(cfg.attention_probs_dropout_prob));
  output_dropout = register_module("output_dropout", Dropout(cfg.hidden_dropout_prob));
  dense = register_module("dense", torch::nn::Linear(cfg.hidden_size, cfg.hidden_size));
  LayerNorm = register_module("LayerNorm", layer_norm(cfg.hidden_size, cfg.layer_norm_eps));
}

at::Tensor AlbertAttentionImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask) {
  const int64_t b = x.size(0), l = x.size(1);
  auto split = [&](const at::Tensor& t) { return t.view({b, l, heads_, head_dim_}).transpose(1, 2); };
  auto q = split(query(x)), k = split(key(x)), v = split(value(x));
  auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(head_dim_));
  if (additive_mask.defined()) scores = scores + additive_mask;
  auto probs = attention_dropout(torch::softmax(scores, -1));
  auto ctx = torch::matmul(probs, v).transpose(1, 2).reshape({b, l, heads_ * head_dim_});
  return norm(LayerNorm, x + output_dropout(dense(ctx)));
}

AlbertLayerImpl::AlbertLayerImpl(const AlbertConfig& cfg) : act_(cfg.hidden_act) {
  full_layer_layer_norm = register_module("full_layer_layer_norm", layer_norm(cfg.hidden_size, cfg.layer_norm_eps));
  attention = register_module("attention", AlbertAttention(cfg));
  ffn = register_module("ffn", torch::nn::Linear(cfg.hidden_size, cfg.intermediate_size));
  ffn_output = register_module("ffn_output", torch::nn::Linear(cfg.intermediate_size, cfg.hidden_size));
  check_hf_activation(act_);  // an unsupported activation fails at build time
}

at::Tensor AlbertLayerImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask) {
  auto a = attention(x, additive_mask);
  // HF applies no dropout to the feed-forward output (AlbertLayer.dropout is never called).
  return norm(full_layer_layer_norm, ffn_output(activation(act_, ffn(a))) + a);
}

AlbertLayerGroupImpl::AlbertLayerGroupImpl(const AlbertConfig& cfg) {
  albert_layers = register_module("albert_layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.inner_group_num; ++i) albert_layers->push_back(AlbertLayer(cfg));
}

AlbertTransformerImpl::AlbertTransformerImpl(const AlbertConfig& cfg)
    : num_hidden_layers_(cfg.num_hidden_layers), num_hidden_groups_(cfg.num_hidden_groups) {
  PT_INPUT_CHECK(cfg.num_hidden_groups > 0 && cfg.num_hidden_layers % cfg.num_hidden_groups == 0,
                 "model.num_hidden_groups (", cfg.num_hidden_groups, ") must divide model.num_hidden_layers (",
                 cfg.num_hidden_layers, ")");
  embedding_hidden_mapping_in =
      register_module("embedding_hidden_mapping_in", torch::nn::Linear(cfg.embedding_size, cfg.hidden_size));
  albert_layer_groups = register_module("albert_layer_groups", torch::nn::ModuleList());
  for (int64_t g = 0; g < cfg.num_hidden_groups; ++g) albert_layer_groups->push_back(AlbertLayerGroup(cfg));
}

at::Tensor AlbertTransformerImpl::apply_group(int64_t i, at::Tensor x, const at::Tensor& additive_mask) {
  auto* group = albert_layer_groups->ptr(group_of(i))->as<AlbertLayerGroupImpl>();
  for (const auto& m : *group->albert_layers) {
    auto* layer = m->as<AlbertLayerImpl>();
    // A shared layer is checkpointed per application: each use keeps only its own input.
    if (checkpoint_layers && is_training())
      x = checkpointed(
          [layer, additive_mask](const at::Tensor& h) {
            return in_layer(*layer, [&] { return layer->forward(h, additive_mask); });
          },
          x);
    else
      x = in_layer(*layer, [&] { return layer->forward(x, additive_mask); });
  }
  return x;
}

at::Tensor AlbertTransformerImpl::forward(const at::Tensor& embeddings, const at::Tensor& additive_mask) {
  at::Tensor x = embedding_hidden_mapping_in(embeddings);
  for (int64_t i = 0; i < num_hidden_layers_; ++i) x = apply_group(i, x, additive_mask);
  return x;
}

AlbertModelImpl::AlbertModelImpl(const AlbertConfig& cfg, bool add_pooling_layer) {
  embeddings = register_module("embeddings", AlbertEmbeddings(cfg));
  encoder = register_module("encoder", AlbertTransformer(cfg));
  if (add_pooling_layer) pooler = register_module("pooler", torch::nn::Linear(cfg.hidden_size, cfg.hidden_size));
}

std::pair<at::Tensor, at::Tensor> AlbertModelImpl::embed(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                                         const at::Tensor& token_type_ids) {
  PT_INPUT_CHECK(input_ids.defined() && input_ids.dim() == 2, "input_ids must be [batch, length], got ",
                 input_ids.defined() ? input_ids.sizes() : at::IntArrayRef{});
  auto types = token_type_ids.defined() ? token_type_ids : torch::zeros_like(input_ids);
  auto h = embeddings(input_ids, types);
  // The mask in the embeddings' dtype (the projection's output may be autocast's).
  auto mask = extended_attention_mask(attention_mask, h.scalar_type());
  return {encoder->embedding_hidden_mapping_in(h), mask};
}

at::Tensor AlbertModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                    const at::Tensor& token_type_ids) {
  auto [x, mask] = embed(input_ids, attention_mask, token_type_ids);
  for (int64_t i = 0; i < encoder->num_hidden_layers_; ++i) x = encoder->apply_group(i, x, mask);
  return x;
}

at::Tensor AlbertModelImpl::pool(const at::Tensor& hidden) {
  return torch::tanh(pooler(hidden.select(1, 0)));
}

AlbertMLMHeadImpl::AlbertMLMHeadImpl(const AlbertConfig& cfg, const at::Tensor& word_embeddings)
    : act_(cfg.hidden_act) {
  LayerNorm = register_module("LayerNorm", layer_norm(cfg.embedding_size, cfg.layer_norm_eps));
  bias = register_parameter("bias", torch::zeros({cfg.vocab_size}));
  dense = register_module("dense", torch::nn::Linear(cfg.hidden_size, cfg.embedding_size));
  if (cfg.tie_word_embeddings) {
    decoder_weight_ = word_embeddings;
  } else {
    // Untied: HF's predictions.decoder.weight is its own tensor (decoder.bias stays predictions.bias).
    auto decoder = std::make_shared<torch::nn::Module>("decoder");
    decoder_weight_ = decoder->register_parameter("weight", torch::empty({cfg.vocab_size, cfg.embedding_size}));
    register_module("decoder", decoder);
  }
}

at::Tensor AlbertMLMHeadImpl::transform(const at::Tensor& hidden) {
  return norm(LayerNorm, activation(act_, dense(hidden)));
}

at::Tensor AlbertMLMHeadImpl::forward(const at::Tensor& hidden) {
  return F::linear(transform(hidden), decoder_weight_, bias);
}

// ---- the model -----------------------------------------------------------------------------------

AlbertForMaskedLMImpl::AlbertForMaskedLMImpl(const AlbertConfig& cfg) : config_(cfg) {
  check_hf_activation(cfg.hidden_act);
  PT_INPUT_CHECK(cfg.hidden_size % cfg.num_attention_heads == 0, "model.hidden_size (", cfg.hidden_size,
                 ") must be divisible by model.num_attention_heads (", cfg.num_attention_heads, ")");
  albert = register_module("albert", AlbertModel(cfg, cfg.sentence_order_prediction));
  predictions = register_module("predictions", AlbertMLMHead(cfg, albert->embeddings->word_embeddings->weight));
  if (cfg.sentence_order_prediction) {
    sop_dropout = Dropout(cfg.classifier_dropout_prob);
    auto sop = std::make_shared<torch::nn::Module>("AlbertSOPHead");
    sop->register_module("dropout", sop_dropout);
    sop_classifier = sop->register_module("classifier", torch::nn::Linear(cfg.hidden_size, 2));
    register_module("sop_classifier", sop);
  }
  init_weights(cfg.initializer_range);
}

void AlbertForMaskedLMImpl::set_activation_checkpointing(bool on) { albert->encoder->checkpoint_layers = on; }

void AlbertForMaskedLMImpl::init_weights(double std) {
  init_hf_weights(*this, std);
  torch::NoGradGuard no_grad;
  if (!config_.tie_word_embeddings) predictions->decoder_weight_.normal_(0.0, std);
  predictions->bias.zero_();
}

AlbertOutput AlbertForMaskedLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                            const at::Tensor& token_type_ids, const at::Tensor& labels,
                                            const at::Tensor& sentence_order_label) {
  PT_INPUT_CHECK(!sentence_order_label.defined() || config_.sentence_order_prediction,
                 "sentence_order_label given, but the model has no SOP head (model.sentence_order_prediction)");
  return heads(albert(input_ids, attention_mask, token_type_ids), labels, sentence_order_label);
}

AlbertOutput AlbertForMaskedLMImpl::heads(const at::Tensor& hidden, const at::Tensor& labels,
                                          const at::Tensor& sentence_order_label) {
  AlbertOutput out;
  out.hidden_states = hidden;
  if (config_.sentence_order_prediction)
    out.sop_logits = sop_classifier(sop_dropout(albert->pool(out.hidden_states)));

  auto head = masked_lm_head(
      out.hidden_states, labels, [&](const at::Tensor& h) { return predictions->transform(h); },
      predictions->decoder_weight_, predictions->bias, config_.sparse_prediction, config_.fused_lm_loss);
  out.loss = head.loss;
  out.logits = head.logits;
  if (sentence_order_label.defined()) {
    auto sop_loss = F::cross_entropy(out.sop_logits, sentence_order_label.reshape({-1}));
    out.loss = out.loss.defined() ? out.loss + sop_loss : sop_loss;
  }
  return out;
}

PipelinePlan AlbertForMaskedLMImpl::pipeline_plan() {
  PipelinePlan plan;
  plan.layers.push_back(embeddings_layer(
      "AlbertEmbeddings", {"albert.embeddings.", "albert.encoder.embedding_hidden_mapping_in."},
      [this](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& types) {
        return albert->embed(ids, mask, types);
      }));
  AlbertTransformerImpl* encoder = albert->encoder.get();
  for (int64_t i = 0; i < encoder->num_hidden_layers_; ++i) {
    plan.layers.push_back(block_layer(
        "layer." + std::to_string(i), "AlbertLayerGroup",
        {"albert.encoder.albert_layer_groups." + std::to_string(encoder->group_of(i)) + "."},
        [encoder, i](const at::Tensor& h, const at::Tensor& mask) { return encoder->apply_group(i, h, mask); }));
  }
  std::vector<std::string> head_params = {"predictions."};
  if (config_.tie_word_embeddings) head_params.push_back("albert.embeddings.word_embeddings.weight");
  if (config_.sentence_order_prediction) {
    head_params.push_back("albert.pooler.");
    head_params.push_back("sop_classifier.");
  }
  plan.layers.push_back(loss_head("AlbertHeads", head_params, [this](const at::Tensor& hidden, const TensorMap& in) {
    // As examples/train_albert.cpp: the order labels only with the SOP head.
    const at::Tensor order =
        config_.sentence_order_prediction ? plan_input(in, "sentence_order_label", "head") : at::Tensor();
    return heads(hidden, plan_input(in, "labels", "head"), order).loss;
  }));
  return plan;
}

void AlbertForMaskedLMImpl::save_pretrained(const std::string& dir) const {
  ::polytrain::save_pretrained(*this, albert_config_to_json(config_), dir);
}

AlbertForMaskedLM AlbertForMaskedLMImpl::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const AlbertConfig cfg =
      albert_config_from_json(read_pretrained_config(dir), (fs::path(dir) / "config.json").string());
  AlbertForMaskedLM model(cfg);
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  PT_INPUT_CHECK(fs::exists(path), path, ": not found (HF sharded or .bin checkpoints are not read; ",
                 "convert them to one model.safetensors)");
  const NamedTensors tensors = load_safetensors(path);

  HfLoadOptions options;
  options.base_prefix = "albert";
  // HF's ignore lists: position_ids buffers of older versions, the tied decoder copies
  // (pytorch_model.bin files carry them), the pooler when the model has none.
  options.ignore_unused = {"(^|\\.)embeddings\\.position_ids$", "(^|\\.)embeddings\\.token_type_ids$",
                           "^predictions\\.decoder\\.bias$"};
  if (cfg.tie_word_embeddings) options.ignore_unused.push_back("^predictions\\.decoder\\.weight$");
  if (!cfg.sentence_order_prediction) options.ignore_unused.push_back("(^|\\.)pooler\\.");
  bool base_checkpoint = true;
  for (const auto& [name, t] : tensors)
    if (name.rfind("albert.", 0) == 0) base_checkpoint = false;
  if (base_checkpoint) {
    // A bare AlbertModel: the heads are not in it and keep their fresh initialisation (HF does so).
    options.optional = {"^predictions\\.", "^sop_classifier\\."};
    if (cfg.sentence_order_prediction) options.optional.push_back("^albert\\.pooler\\.");
  }
  load_named_tensors(*model, tensors, options, path);
  return model;
}

}  // namespace polytrain
