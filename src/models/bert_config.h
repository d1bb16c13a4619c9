// BERT/RoBERTa's configuration: the polytrain config's `model` section (ModelConfig, Hugging
// Face config.json field names), its key table, and config.json <-> ModelConfig. No torch: the
// model lives in models/bert.h. GPT-2, T5 and ALBERT have theirs beside it (<family>_config.h).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

/// `model` section: Hugging Face config.json field names (an HF config.json drops in).
struct ModelConfig {
  std::string model_type = "bert";  ///< bert, roberta
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  std::string hidden_act = "gelu";
  double hidden_dropout_prob = 0.1;
  double attention_probs_dropout_prob = 0.1;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double layer_norm_eps = 1e-12;
  double initializer_range = 0.02;
  int64_t pad_token_id = 0;
  bool tie_word_embeddings = true;
  /// polytrain: compute the MLM head only at labelled positions (NVIDIA/Megatron BERT's
  /// sparse prediction): same loss and gradients, ~6x less head work at 15% masking. With
  /// labels and fused_lm_loss off, logits are then [labelled positions, vocab].
  bool sparse_prediction = true;
  /// polytrain: with labels, compute the LM loss chunk by chunk without materialising the
  /// [tokens, vocab] logits (same loss and gradients to rounding; logits are not returned).
  bool fused_lm_loss = true;
  /// Attention: "auto" (sdpa on CUDA, eager elsewhere), "eager" (the exact math), "sdpa"
  /// (LibTorch's fused kernels); models/attention.h.
  std::string attn_implementation = "auto";
  /// Other HF keys (architectures, torch_dtype, ...) kept verbatim for export.
  nlohmann::json extra = nlohmann::json::object();
};

/// The `model` section's keys for BERT/RoBERTa, each with its field (the strict reader and
/// the writer of common/config_keys.h walk it).
template <class V>
void visit(V& v, ModelConfig& m) {
  v("model_type", m.model_type), v("vocab_size", m.vocab_size), v("hidden_size", m.hidden_size);
  v("num_hidden_layers", m.num_hidden_layers), v("num_attention_heads", m.num_attention_heads);
  v("intermediate_size", m.intermediate_size), v("hidden_act", m.hidden_act);
  v("hidden_dropout_prob", m.hidden_dropout_prob);
  v("attention_probs_dropout_prob", m.attention_probs_dropout_prob);
  v("max_position_embeddings", m.max_position_embeddings), v("type_vocab_size", m.type_vocab_size);
  v("layer_norm_eps", m.layer_norm_eps), v("initializer_range", m.initializer_range);
  v("pad_token_id", m.pad_token_id), v("tie_word_embeddings", m.tie_word_embeddings);
  v("sparse_prediction", m.sparse_prediction), v("fused_lm_loss", m.fused_lm_loss);
  v("attn_implementation", m.attn_implementation);
}

/// The HF config.json of a BERT/RoBERTa ModelConfig: model_type bert or roberta, architectures
/// [BertForMaskedLM] or [RobertaForMaskedLM], every ModelConfig field and the kept extra keys.
nlohmann::json bert_config_to_json(const ModelConfig& cfg);

/// Reads an HF BERT/RoBERTa config.json object with the polytrain config's own `model` parser
/// (same defaults and checks); InputError messages name `origin` (the file) and the key.
ModelConfig bert_config_from_json(const nlohmann::json& j, const std::string& origin);

}  // namespace polytrain
