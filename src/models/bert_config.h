// BERT/RoBERTa's Hugging Face config.json <-> the polytrain ModelConfig (common/config.h). No
// torch: the model lives in models/bert.h.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace polytrain {

/// The HF config.json of a BERT/RoBERTa ModelConfig: model_type bert or roberta, architectures
/// [BertForMaskedLM] or [RobertaForMaskedLM], every ModelConfig field and the kept extra keys.
nlohmann::json bert_config_to_json(const ModelConfig& cfg);

/// Reads an HF BERT/RoBERTa config.json object with the polytrain config's own `model` parser
/// (same defaults and checks); InputError messages name `origin` (the file) and the key.
ModelConfig bert_config_from_json(const nlohmann::json& j, const std::string& origin);

}  // namespace polytrain
