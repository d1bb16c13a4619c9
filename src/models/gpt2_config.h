// GPT-2's Hugging Face config (GPT2Config: field names, defaults, aliases) read from config.json
// or a polytrain config's `model` section, and written back as HF writes it. No torch: the
// model lives in models/gpt2.h.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

/// HF GPT2Config: its field names and defaults (GPT-2 small).
struct Gpt2Config {
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_inner = 0;  ///< 0 (HF: null) = 4 * n_embd
  std::string activation_function = "gelu_new";
  double resid_pdrop = 0.1, embd_pdrop = 0.1, attn_pdrop = 0.1;
  double layer_norm_epsilon = 1e-5;
  double initializer_range = 0.02;
  bool scale_attn_weights = true;
  bool scale_attn_by_inverse_layer_idx = false;
  bool reorder_and_upcast_attn = false;  ///< accepted; the math is the same in fp32
  bool tie_word_embeddings = true;
  int64_t bos_token_id = 50256, eos_token_id = 50256;
  /// polytrain: with labels, compute the loss without the [tokens, vocab] logits
  /// (models/fused_lm_loss.h); logits are then not returned.
  bool fused_lm_loss = true;
  /// polytrain: "auto" (sdpa on CUDA, eager elsewhere), "eager" (the exact math) or "sdpa"
  /// (models/attention.h).
  std::string attn_implementation = "auto";
  nlohmann::json extra = nlohmann::json::object();  ///< other HF keys, kept for export
};

/// Reads an HF GPT-2 config.json (or a `model` section with model_type gpt2): HF's aliases
/// (hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings) accepted.
/// InputError naming `origin` and the key for a bad value.
Gpt2Config gpt2_config_from_json(const nlohmann::json& j, const std::string& origin);
/// HF config.json: model_type gpt2, architectures [GPT2LMHeadModel], every field.
nlohmann::json gpt2_config_to_json(const Gpt2Config& c);

}  // namespace polytrain
