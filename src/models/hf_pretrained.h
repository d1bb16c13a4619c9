// Hugging Face's save_pretrained / from_pretrained file layout (config.json + model.safetensors)
// for any polytrain model whose registered parameter names are HF's state_dict keys. The model
// families (bert, albert, gpt2, t5) choose the names and the config; this file moves the tensors.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "polytrain/checkpoint/safetensors.h"

namespace polytrain {

/// How checkpoint names meet model names when loading.
struct HfLoadOptions {
  /// HF's base_model_prefix ("bert", "roberta", "albert", "transformer"; "" for T5): a checkpoint
  /// of the bare base model (BertModel, GPT2Model: names without the prefix) loads into the
  /// model with a head; the head's own parameters must then be `optional`.
  std::string base_prefix;
  /// ECMAScript regexes (std::regex_search) of model tensors a checkpoint may lack: tied copies
  /// and heads a base-model checkpoint has not got. They keep their current values.
  std::vector<std::string> optional;
  /// Regexes of checkpoint tensors that may be left unused (HF's _keys_to_ignore_on_load_unexpected:
  /// GPT-2's attn.bias causal masks, tied lm_head copies, ...).
  std::vector<std::string> ignore_unused;
};

/// Writes dir/model.safetensors (every parameter and buffer of `model` under its registered name,
/// minus names matching a `skip` regex; metadata {"format": "pt"} as transformers writes it) and
/// then dir/config.json (`config`, 2-space indented). Each file is written atomically; dir is
/// created when missing.
void save_pretrained(const torch::nn::Module& model, const nlohmann::json& config, const std::string& dir,
                     const std::vector<std::string>& skip = {});

/// dir/config.json, parsed strictly (InputError naming the file when missing or malformed).
nlohmann::json read_pretrained_config(const std::string& dir);

/// Copies `tensors` into the parameters and buffers of `model` with the same names, converting
/// dtype and device. A model tensor the checkpoint lacks, a checkpoint tensor the model has no
/// place for, or a shape mismatch is an InputError naming `origin` and the tensors; on error
/// nothing has been copied.
void load_named_tensors(torch::nn::Module& model, const NamedTensors& tensors, const HfLoadOptions& options,
                        const std::string& origin);

/// load_named_tensors from dir/model.safetensors.
void load_pretrained_weights(torch::nn::Module& model, const std::string& dir, const HfLoadOptions& options);

}  // namespace polytrain
