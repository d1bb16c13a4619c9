// GPT-2: Gpt2Config <-> HF config.json (models/gpt2_config.h).
#include "polytrain/models/gpt2_config.h"

#include <algorithm>

#include "polytrain/models/hf_config.h"
#include "polytrain/models/model_keys.h"

namespace polytrain {

Gpt2Config gpt2_config_from_json(const nlohmann::json& j, const std::string& origin) {
  HfConfigReader r(j, origin);
  Gpt2Config c;
  if (r.has("model_type") && r.get<std::string>("model_type", "") != "gpt2")
    r.fail("model_type", "is '" + r.get<std::string>("model_type", "") + "', expected 'gpt2'");
  c.vocab_size = r.positive("vocab_size", c.vocab_size);
  c.n_positions = r.positive("n_positions", c.n_positions, {"max_position_embeddings"});
  c.n_embd = r.positive("n_embd", c.n_embd, {"hidden_size"});
  c.n_layer = r.positive("n_layer", c.n_layer, {"num_hidden_layers"});
  c.n_head = r.positive("n_head", c.n_head, {"num_attention_heads"});
  c.n_inner = r.get<int64_t>("n_inner", 0);
  if (c.n_inner < 0) r.fail("n_inner", "must be > 0 or null, got " + std::to_string(c.n_inner));
  c.activation_function = r.get<std::string>("activation_function", c.activation_function);
  check_hf_activation(c.activation_function, "model.activation_function");  // here, not mid-run
  c.resid_pdrop = r.probability("resid_pdrop", c.resid_pdrop);
  c.embd_pdrop = r.probability("embd_pdrop", c.embd_pdrop);
  c.attn_pdrop = r.probability("attn_pdrop", c.attn_pdrop);
  c.layer_norm_epsilon = r.get<double>("layer_norm_epsilon", c.layer_norm_epsilon);
  if (!(c.layer_norm_epsilon > 0)) r.fail("layer_norm_epsilon", "must be > 0");
  c.initializer_range = r.get<double>("initializer_range", c.initializer_range);
  if (!(c.initializer_range >= 0)) r.fail("initializer_range", "must be >= 0");
  c.scale_attn_weights = r.get<bool>("scale_attn_weights", c.scale_attn_weights);
  c.scale_attn_by_inverse_layer_idx = r.get<bool>("scale_attn_by_inverse_layer_idx", false);
  c.reorder_and_upcast_attn = r.get<bool>("reorder_and_upcast_attn", false);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", true);
  c.bos_token_id = r.get<int64_t>("bos_token_id", c.bos_token_id);
  c.eos_token_id = r.get<int64_t>("eos_token_id", c.eos_token_id);
  c.fused_lm_loss = r.get<bool>("fused_lm_loss", true);
  c.attn_implementation = r.get<std::string>("attn_implementation", c.attn_implementation);
  if (c.attn_implementation != "auto" && c.attn_implementation != "eager" && c.attn_implementation != "sdpa")
    r.fail("attn_implementation", "must be \"auto\", \"eager\" or \"sdpa\", got \"" + c.attn_implementation + "\"");
  if (c.n_embd % c.n_head != 0)
    r.fail("n_embd", "(" + std::to_string(c.n_embd) + ") must be divisible by n_head (" +
                         std::to_string(c.n_head) + ")");
  for (const auto& item : j.items())
    if (std::find(kGpt2ConfigKeys.begin(), kGpt2ConfigKeys.end(), item.key()) == kGpt2ConfigKeys.end())
      c.extra[item.key()] = item.value();
  return c;
}

nlohmann::json gpt2_config_to_json(const Gpt2Config& c) {
  nlohmann::json j = c.extra;
  j["model_type"] = "gpt2";
  if (!j.contains("architectures")) j["architectures"] = {"GPT2LMHeadModel"};
  j["vocab_size"] = c.vocab_size, j["n_positions"] = c.n_positions, j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer, j["n_head"] = c.n_head;
  j["n_inner"] = c.n_inner > 0 ? nlohmann::json(c.n_inner) : nlohmann::json(nullptr);
  j["activation_function"] = c.activation_function;
  j["resid_pdrop"] = c.resid_pdrop, j["embd_pdrop"] = c.embd_pdrop, j["attn_pdrop"] = c.attn_pdrop;
  j["layer_norm_epsilon"] = c.layer_norm_epsilon, j["initializer_range"] = c.initializer_range;
  j["scale_attn_weights"] = c.scale_attn_weights;
  j["scale_attn_by_inverse_layer_idx"] = c.scale_attn_by_inverse_layer_idx;
  j["reorder_and_upcast_attn"] = c.reorder_and_upcast_attn;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id, j["eos_token_id"] = c.eos_token_id;
  return j;
}

}  // namespace polytrain
