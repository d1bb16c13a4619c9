// ALBERT's Hugging Face config (AlbertConfig: field names, defaults) read from config.json or
// a polytrain config's `model` section, and written back as HF writes it. No torch: the model
// lives in models/albert.h.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

/// HF AlbertConfig: field names and defaults as transformers' configuration_albert.py.
struct AlbertConfig {
  int64_t vocab_size = 30000;
  int64_t embedding_size = 128;
  int64_t hidden_size = 4096;
  int64_t num_hidden_layers = 12;
  int64_t num_hidden_groups = 1;  ///< distinct parameter sets the layers cycle through, in blocks
  int64_t num_attention_heads = 64;
  int64_t intermediate_size = 16384;
  int64_t inner_group_num = 1;    ///< layers inside one group, applied in turn
  std::string hidden_act = "gelu_new";
  double hidden_dropout_prob = 0.0;
  double attention_probs_dropout_prob = 0.0;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double initializer_range = 0.02;
  double layer_norm_eps = 1e-12;
  double classifier_dropout_prob = 0.1;  ///< SOP head's dropout
  int64_t pad_token_id = 0;
  int64_t bos_token_id = 2;
  int64_t eos_token_id = 3;
  bool tie_word_embeddings = true;  ///< decoder weight = word embeddings (HF PretrainedConfig)
  /// polytrain: build AlbertForPreTraining's heads too (albert.pooler + sop_classifier). Default:
  /// true when `architectures` names AlbertForPreTraining.
  bool sentence_order_prediction = false;
  /// polytrain: as ModelConfig::sparse_prediction (score only labelled positions).
  bool sparse_prediction = true;
  /// polytrain: as ModelConfig::fused_lm_loss (loss without the [tokens, vocab] logits).
  bool fused_lm_loss = true;
  /// Other keys of the source (architectures, torch_dtype, ...), kept verbatim for export.
  nlohmann::json extra = nlohmann::json::object();
};

/// Reads an HF config.json object (or a polytrain `model` section: model_type may be absent).
/// InputError naming `origin` and the key for a wrong type or value, e.g. hidden_size not
/// divisible by num_attention_heads or num_hidden_groups not dividing num_hidden_layers.
AlbertConfig albert_config_from_json(const nlohmann::json& j, const std::string& origin);

/// The config.json HF writes: model_type "albert", architectures [AlbertForMaskedLM] or
/// [AlbertForPreTraining], every AlbertConfig field, and the kept extra keys.
nlohmann::json albert_config_to_json(const AlbertConfig& cfg);

}  // namespace polytrain
