// ALBERT: AlbertConfig <-> HF config.json (models/albert_config.h).
#include "polytrain/models/albert_config.h"

#include "polytrain/models/hf_config.h"
#include "polytrain/models/model_keys.h"

namespace polytrain {

using nlohmann::json;

AlbertConfig albert_config_from_json(const json& j, const std::string& origin) {
  HfConfigReader r(j, origin);
  AlbertConfig c;
  const std::string type = r.get<std::string>("model_type", "albert");
  if (type != "albert") r.fail("model_type", "is '" + type + "', this reader builds 'albert'");
  c.vocab_size = r.positive("vocab_size", c.vocab_size);
  c.embedding_size = r.positive("embedding_size", c.embedding_size);
  c.hidden_size = r.positive("hidden_size", c.hidden_size, {"d_model"});
  c.num_hidden_layers = r.positive("num_hidden_layers", c.num_hidden_layers);
  c.num_hidden_groups = r.positive("num_hidden_groups", c.num_hidden_groups);
  c.num_attention_heads = r.positive("num_attention_heads", c.num_attention_heads);
  c.intermediate_size = r.positive("intermediate_size", c.intermediate_size);
  c.inner_group_num = r.positive("inner_group_num", c.inner_group_num);
  c.hidden_act = r.get<std::string>("hidden_act", c.hidden_act);
  c.hidden_dropout_prob = r.probability("hidden_dropout_prob", c.hidden_dropout_prob);
  c.attention_probs_dropout_prob = r.probability("attention_probs_dropout_prob", c.attention_probs_dropout_prob);
  c.max_position_embeddings = r.positive("max_position_embeddings", c.max_position_embeddings);
  c.type_vocab_size = r.positive("type_vocab_size", c.type_vocab_size);
  c.initializer_range = r.get<double>("initializer_range", c.initializer_range);
  c.layer_norm_eps = r.get<double>("layer_norm_eps", c.layer_norm_eps);
  c.classifier_dropout_prob = r.probability("classifier_dropout_prob", c.classifier_dropout_prob);
  c.pad_token_id = r.get<int64_t>("pad_token_id", c.pad_token_id);
  c.bos_token_id = r.get<int64_t>("bos_token_id", c.bos_token_id);
  c.eos_token_id = r.get<int64_t>("eos_token_id", c.eos_token_id);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", c.tie_word_embeddings);
  c.sentence_order_prediction =
      r.get<bool>("sentence_order_prediction", names_architecture(j, "AlbertForPreTraining"));
  c.sparse_prediction = r.get<bool>("sparse_prediction", c.sparse_prediction);
  c.fused_lm_loss = r.get<bool>("fused_lm_loss", c.fused_lm_loss);

  if (c.hidden_size % c.num_attention_heads != 0)
    r.fail("hidden_size", "(" + std::to_string(c.hidden_size) + ") must be divisible by num_attention_heads (" +
                              std::to_string(c.num_attention_heads) + ")");
  // HF tolerates an uneven split (int(i / (L / G)) over floats); every group would still be used
  // but some more often than others, which is almost surely a typo: refused.
  if (c.num_hidden_layers % c.num_hidden_groups != 0)
    r.fail("num_hidden_groups", "(" + std::to_string(c.num_hidden_groups) + ") must divide num_hidden_layers (" +
                                    std::to_string(c.num_hidden_layers) + ")");
  if (!is_hf_activation(c.hidden_act))
    r.fail("hidden_act", "'" + c.hidden_act + "' is not supported (supported: " + hf_activation_names() + ")");
  if (!(c.layer_norm_eps > 0.0)) r.fail("layer_norm_eps", "must be > 0, got " + std::to_string(c.layer_norm_eps));
  if (!(c.initializer_range >= 0.0))
    r.fail("initializer_range", "must be >= 0, got " + std::to_string(c.initializer_range));
  if (c.pad_token_id < 0 || c.pad_token_id >= c.vocab_size)
    r.fail("pad_token_id", "must be in [0, vocab_size = " + std::to_string(c.vocab_size) + "), got " +
                               std::to_string(c.pad_token_id));
  const std::string pos = r.get<std::string>("position_embedding_type", "absolute");
  if (pos != "absolute") r.fail("position_embedding_type", "'" + pos + "' is not supported (only 'absolute')");

  c.extra = j;
  for (const std::string& key : kAlbertConfigKeys)
    c.extra.erase(key);
  return c;
}

json albert_config_to_json(const AlbertConfig& c) {
  json j = c.extra.is_object() ? c.extra : json::object();
  j["architectures"] = {c.sentence_order_prediction ? "AlbertForPreTraining" : "AlbertForMaskedLM"};
  j["model_type"] = "albert";
  j["vocab_size"] = c.vocab_size;
  j["embedding_size"] = c.embedding_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_hidden_groups"] = c.num_hidden_groups;
  j["num_attention_heads"] = c.num_attention_heads;
  j["intermediate_size"] = c.intermediate_size;
  j["inner_group_num"] = c.inner_group_num;
  j["hidden_act"] = c.hidden_act;
  j["hidden_dropout_prob"] = c.hidden_dropout_prob;
  j["attention_probs_dropout_prob"] = c.attention_probs_dropout_prob;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["type_vocab_size"] = c.type_vocab_size;
  j["initializer_range"] = c.initializer_range;
  j["layer_norm_eps"] = c.layer_norm_eps;
  j["classifier_dropout_prob"] = c.classifier_dropout_prob;
  j["position_embedding_type"] = "absolute";
  j["pad_token_id"] = c.pad_token_id;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["sentence_order_prediction"] = c.sentence_order_prediction;
  j["sparse_prediction"] = c.sparse_prediction;
  j["fused_lm_loss"] = c.fused_lm_loss;
  return j;
}

}  // namespace polytrain
