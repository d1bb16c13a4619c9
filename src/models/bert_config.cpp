// BERT/RoBERTa: ModelConfig <-> HF config.json (models/bert_config.h).
#include "polytrain/models/bert_config.h"

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {

nlohmann::json bert_config_to_json(const ModelConfig& cfg) {
  Config whole;
  whole.model = cfg;
  nlohmann::json j = config_to_json(whole)["model"];
  j["architectures"] = {cfg.model_type == "roberta" ? "RobertaForMaskedLM" : "BertForMaskedLM"};
  return j;
}

ModelConfig bert_config_from_json(const nlohmann::json& j, const std::string& origin) {
  PT_INPUT_CHECK(j.is_object(), origin, ": a model config must be a JSON object");
  ModelConfig m;
  try {
    // The polytrain config's `model` parser, so defaults and checks live in one place; the
    // smallest batch and sequence length keep the other sections' checks out of the way.
    const nlohmann::json doc = {{"model", j}, {"train_micro_batch_size_per_gpu", 1}, {"data", {{"max_seq_length", 8}}}};
    m = config_from_json(doc, origin, 1).model;
  } catch (const InputError& e) {
    // Messages name keys as 'model.<key>'; in a config.json they are top-level keys.
    std::string msg = e.what();
    for (size_t at = msg.find("'model."); at != std::string::npos; at = msg.find("'model.", at)) msg.erase(at + 1, 6);
    throw InputError(msg);
  }
  PT_INPUT_CHECK(m.model_type == "bert" || m.model_type == "roberta", origin, ": 'model_type' is '", m.model_type,
                 "', a BERT/RoBERTa checkpoint needs bert or roberta");
  const auto pos = m.extra.find("position_embedding_type");
  PT_INPUT_CHECK(pos == m.extra.end() || pos->is_null() || *pos == "absolute", origin,
                 ": 'position_embedding_type' ", pos == m.extra.end() ? "" : pos->dump(),
                 " is not supported (only \"absolute\")");
  const auto decoder = m.extra.find("is_decoder");
  PT_INPUT_CHECK(decoder == m.extra.end() || *decoder != true, origin,
                 ": 'is_decoder' true (a causal BERT) is not supported by the masked-LM model");
  return m;
}

}  // namespace polytrain
