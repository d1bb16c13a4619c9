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

}  // namespace polytrain::testing
