// Test helper: a config of configs/ to change and write elsewhere. The shipped configs name
// their data files relative to their own folder; a copy written into a test's folder gets
// those paths made absolute, so that it reads the same files from anywhere.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace polytrain::testing {

/// configs/NAME (e.g. "bert_tiny.json") parsed, with each relative path of its `data` section
/// that names a file beside configs/ made absolute.
inline nlohmann::json shipped_config(const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path folder = fs::path(POLYTRAIN_SOURCE_DIR) / "configs";
  nlohmann::json c = nlohmann::json::parse(std::ifstream(folder / name));
  auto absolute = [&](nlohmann::json& v) {
    if (!v.is_string()) return;
    const fs::path p = v.get<std::string>();
    if (p.is_relative() && fs::exists(folder / p)) v = fs::weakly_canonical(folder / p).string();
  };
  if (c.contains("data") && c["data"].is_object())
    for (auto& [key, value] : c["data"].items()) {
      if (value.is_array())
        for (auto& item : value) absolute(item);
      else
        absolute(value);
    }
  return c;
}

/// The BERT vocabulary the corpus tests need (scripts/fetch_assets.sh puts it in .cache/assets).
inline bool bert_vocab_present() {
  return std::filesystem::exists(std::filesystem::path(POLYTRAIN_SOURCE_DIR) /
                                 ".cache/assets/vocab/bert-base-uncased-vocab.txt");
}

/// bert_tiny.json as the multi-process tests run it: dropout off, no gradient accumulation,
/// every step logged, no eval until step 1000, no progress bar, safetensors checkpoints,
/// experiments under `experiments_dir`, `num_threads` threads per process.
inline nlohmann::json deterministic_bert_tiny(const std::filesystem::path& experiments_dir, int num_threads) {
  nlohmann::json c = shipped_config("bert_tiny.json");
  c["model"]["hidden_dropout_prob"] = 0.0;
  c["model"]["attention_probs_dropout_prob"] = 0.0;
  c.erase("gradient_accumulation_steps");
  c["trainer"]["num_threads"] = num_threads;
  c["trainer"]["eval_interval"] = 1000;
  c["trainer"]["log_interval"] = 1;
  c["trainer"]["progress_bar"] = false;
  c["trainer"]["save_safetensors"] = true;
  c["trainer"]["experiments_dir"] = experiments_dir.string();
  return c;
}

}  // namespace polytrain::testing
