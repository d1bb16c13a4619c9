// T5's Hugging Face config (T5Config: field names, defaults, the feed_forward_proj grammar) read
// from config.json or a polytrain config's `model` section, and written back as HF writes it.
// The model itself lives in models/t5.h.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

/// HF T5Config (transformers/models/t5/configuration_t5.py): same names, same defaults.
struct T5Config {
  int64_t vocab_size = 32128, d_model = 512, d_kv = 64, d_ff = 2048, num_layers = 6;
  int64_t num_decoder_layers = -1;  ///< -1 (or null in JSON): = num_layers
  int64_t num_heads = 8, relative_attention_num_buckets = 32, relative_attention_max_distance = 128;
  double dropout_rate = 0.1, layer_norm_epsilon = 1e-6, initializer_factor = 1.0;
  /// "{act}" or "gated-{act}": relu (T5 v1.0), gated-gelu (v1.1, flan-t5: gelu_new), gelu, gated-silu, ...
  std::string feed_forward_proj = "relu";
  /// true (v1.0): lm_head is shared.weight and the decoder output is scaled by d_model^-0.5 first;
  /// false (v1.1): lm_head.weight of its own, no scaling.
  bool tie_word_embeddings = true;
  int64_t pad_token_id = 0, eos_token_id = 1, decoder_start_token_id = 0;
  /// polytrain: "auto" (sdpa on CUDA, eager elsewhere), "eager" or "sdpa" (models/attention.h).
  std::string attn_implementation = "auto";
  nlohmann::json extra = nlohmann::json::object();  ///< other HF keys, kept for export

  int64_t decoder_layers() const { return num_decoder_layers < 0 ? num_layers : num_decoder_layers; }
  /// The activation's name in HF's ACT2FN ("gated-gelu" -> "gelu_new", as HF's T5Config does).
  std::string dense_act_fn() const;
  bool is_gated_act() const;
};

/// Reads an HF T5 config.json object (or a polytrain `model` section with model_type "t5").
/// Accepts HF's attribute aliases (hidden_size, num_attention_heads, num_hidden_layers, head_dim).
/// InputError "<origin>: '<key>' ..." for a wrong type or value; unknown keys go to `extra`.
T5Config t5_config_from_json(const nlohmann::json& j, const std::string& origin);

/// HF config.json: model_type "t5", architectures ["T5ForConditionalGeneration"], every field
/// (plus dense_act_fn / is_gated_act as transformers writes them) over the kept extra keys.
nlohmann::json t5_config_to_json(const T5Config& c);

}  // namespace polytrain
