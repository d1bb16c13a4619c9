// T5Config <-> JSON with HF's defaults, aliases and the checks HF's T5Config.__init__ makes,
// plus the ones whose absence would only show up as NaNs or index errors in the forward pass.
#include "polytrain/models/t5_config.h"

#include <algorithm>
#include <set>

#include "polytrain/models/hf_config.h"
#include "polytrain/models/model_keys.h"

namespace polytrain {

namespace {

// Activations T5 checkpoints use (ACT2FN names); models/t5.cpp implements each of them.
const std::set<std::string> kActivations = {"relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                                            "silu", "swish", "tanh"};

// HF's grammar: "{act}" or "gated-{act}".
bool split_proj(const std::string& proj, bool* gated, std::string* act) {
  const auto dash = proj.find('-');
  if (dash == std::string::npos) {
    *gated = false, *act = proj;
    return !proj.empty();
  }
  *gated = true, *act = proj.substr(dash + 1);
  return proj.substr(0, dash) == "gated" && !act->empty() && act->find('-') == std::string::npos;
}

}  // namespace

std::string T5Config::dense_act_fn() const {
  if (feed_forward_proj == "gated-gelu") return "gelu_new";  // HF: "for backwards compatibility"
  bool gated;
  std::string act;
  split_proj(feed_forward_proj, &gated, &act);
  return act;
}

bool T5Config::is_gated_act() const { return feed_forward_proj.rfind("gated-", 0) == 0; }

T5Config t5_config_from_json(const nlohmann::json& j, const std::string& origin) {
  const HfConfigReader r(j, origin);
  T5Config c;
  c.vocab_size = r.positive("vocab_size", c.vocab_size);
  c.d_model = r.positive("d_model", c.d_model, {"hidden_size"});
  c.d_kv = r.positive("d_kv", c.d_kv, {"head_dim"});
  c.d_ff = r.positive("d_ff", c.d_ff);
  c.num_layers = r.positive("num_layers", c.num_layers, {"num_hidden_layers"});
  c.num_decoder_layers = r.has("num_decoder_layers") ? r.positive("num_decoder_layers", 1) : -1;
  c.num_heads = r.positive("num_heads", c.num_heads, {"num_attention_heads"});
  c.relative_attention_num_buckets = r.positive("relative_attention_num_buckets", c.relative_attention_num_buckets);
  c.relative_attention_max_distance =
      r.positive("relative_attention_max_distance", c.relative_attention_max_distance);
  c.dropout_rate = r.probability("dropout_rate", c.dropout_rate);
  c.layer_norm_epsilon = r.get<double>("layer_norm_epsilon", c.layer_norm_epsilon);
  c.initializer_factor = r.get<double>("initializer_factor", c.initializer_factor);
  c.feed_forward_proj = r.get<std::string>("feed_forward_proj", c.feed_forward_proj);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", c.tie_word_embeddings);
  c.pad_token_id = r.get<int64_t>("pad_token_id", c.pad_token_id);
  c.eos_token_id = r.get<int64_t>("eos_token_id", c.eos_token_id);
  // HF's T5 configs set it to the pad token; absent, generation falls back to pad_token_id too.
  c.decoder_start_token_id = r.get<int64_t>("decoder_start_token_id", c.pad_token_id);
  c.attn_implementation = r.get<std::string>("attn_implementation", c.attn_implementation);
  if (c.attn_implementation != "auto" && c.attn_implementation != "eager" && c.attn_implementation != "sdpa")
    r.fail("attn_implementation", "must be \"auto\", \"eager\" or \"sdpa\", got \"" + c.attn_implementation + "\"");

  if (!(c.layer_norm_epsilon > 0)) r.fail("layer_norm_epsilon", "must be > 0");
  if (!(c.initializer_factor > 0)) r.fail("initializer_factor", "must be > 0");
  bool gated;
  std::string act;
  if (!split_proj(c.feed_forward_proj, &gated, &act))
    r.fail("feed_forward_proj", "must be '{ACT}' or 'gated-{ACT}' (e.g. 'relu', 'gated-gelu'), got '" +
                                    c.feed_forward_proj + "'");
  if (!kActivations.count(c.dense_act_fn()))
    r.fail("feed_forward_proj", "activation '" + c.dense_act_fn() +
                                    "' is not supported (relu, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, "
                                    "silu, swish, tanh)");
  // transformers writes the derived values too; a file where they disagree is not one it wrote.
  if (r.has("dense_act_fn") && r.get<std::string>("dense_act_fn", "") != c.dense_act_fn())
    r.fail("dense_act_fn", "('" + j.at("dense_act_fn").get<std::string>() + "') disagrees with feed_forward_proj '" +
                               c.feed_forward_proj + "' ('" + c.dense_act_fn() + "')");
  if (r.has("is_gated_act") && r.get<bool>("is_gated_act", false) != c.is_gated_act())
    r.fail("is_gated_act", "disagrees with feed_forward_proj '" + c.feed_forward_proj + "'");
  // Bucketing needs at least one exact bucket per direction and a log range above it (the
  // decoder's unidirectional buckets reach num_buckets / 2 exactly); else log(0) indexes garbage.
  if (c.relative_attention_num_buckets < 4)
    r.fail("relative_attention_num_buckets", "must be >= 4, got " + std::to_string(c.relative_attention_num_buckets));
  if (c.relative_attention_max_distance <= c.relative_attention_num_buckets / 2)
    r.fail("relative_attention_max_distance", "must be > relative_attention_num_buckets / 2 (" +
                                                  std::to_string(c.relative_attention_num_buckets / 2) + "), got " +
                                                  std::to_string(c.relative_attention_max_distance));
  for (const char* key : {"pad_token_id", "decoder_start_token_id"}) {
    const int64_t v = key[0] == 'p' ? c.pad_token_id : c.decoder_start_token_id;
    if (v < 0 || v >= c.vocab_size)
      r.fail(key, "must be in [0, vocab_size = " + std::to_string(c.vocab_size) + "), got " + std::to_string(v));
  }

  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(kT5ConfigKeys.begin(), kT5ConfigKeys.end(), it.key()) == kT5ConfigKeys.end())
      c.extra[it.key()] = it.value();
  return c;
}

nlohmann::json t5_config_to_json(const T5Config& c) {
  nlohmann::json out = c.extra.is_object() ? c.extra : nlohmann::json::object();
  out["model_type"] = "t5";
  out["architectures"] = nlohmann::json::array({"T5ForConditionalGeneration"});
  out["vocab_size"] = c.vocab_size;
  out["d_model"] = c.d_model;
  out["d_kv"] = c.d_kv;
  out["d_ff"] = c.d_ff;
  out["num_layers"] = c.num_layers;
  out["num_decoder_layers"] = c.decoder_layers();
  out["num_heads"] = c.num_heads;
  out["relative_attention_num_buckets"] = c.relative_attention_num_buckets;
  out["relative_attention_max_distance"] = c.relative_attention_max_distance;
  out["dropout_rate"] = c.dropout_rate;
  out["layer_norm_epsilon"] = c.layer_norm_epsilon;
  out["initializer_factor"] = c.initializer_factor;
  out["feed_forward_proj"] = c.feed_forward_proj;
  out["dense_act_fn"] = c.dense_act_fn();
  out["is_gated_act"] = c.is_gated_act();
  out["tie_word_embeddings"] = c.tie_word_embeddings;
  out["pad_token_id"] = c.pad_token_id;
  out["eos_token_id"] = c.eos_token_id;
  out["decoder_start_token_id"] = c.decoder_start_token_id;
  out["is_encoder_decoder"] = true;
  if (!out.contains("use_cache")) out["use_cache"] = true;
  return out;
}

}  // namespace polytrain
