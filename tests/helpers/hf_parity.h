// Test helper: runs scripts/hf_parity.py (the plain-PyTorch reference of each HF model family,
// on Debian's python3-torch) on a model directory and inputs, and returns its outputs; and the
// tools of the bad-checkpoint tests (rewrite a good checkpoint, expect an InputError).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/common/error.h"
#include "helpers/process.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/checkpoint/safetensors.h"

namespace polytrain::testing {

/// Writes `inputs` next to model_dir, runs the reference and returns its outputs (by name).
/// On failure sets *error to the script's output and returns nothing.
inline NamedTensors python_reference(const std::string& model_dir, const NamedTensors& inputs,
                                     std::string* error) {
  namespace fs = std::filesystem;
  const std::string in = (fs::path(model_dir) / "parity_inputs.safetensors").string();
  const std::string out = (fs::path(model_dir) / "parity_outputs.safetensors").string();
  save_safetensors(in, inputs);
  std::string log;
  const int rc = run_command(std::string("/usr/bin/python3 ") + POLYTRAIN_SOURCE_DIR + "/scripts/hf_parity.py " +
                                 model_dir + " " + in + " " + out + " 2>&1",
                             &log);
  if (rc != 0) {
    *error = "hf_parity.py exited " + std::to_string(rc) + ": " + log;
    return {};
  }
  return load_safetensors(out);
}

}  // namespace polytrain::testing

namespace polytrain::testing {

/// Loads dir/model.safetensors, lets `edit` change the tensors, writes them back: for making
/// a good HF checkpoint bad in one chosen way.
inline void rewrite_safetensors(const std::string& dir, const std::function<void(NamedTensors&)>& edit) {
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  auto t = load_safetensors(path);
  edit(t);
  save_safetensors(path, t);
}

/// The same for dir/config.json.
inline void rewrite_config_json(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto j = read_pretrained_config(dir);
  edit(j);
  std::ofstream((std::filesystem::path(dir) / "config.json").string()) << j.dump(2);
}

/// Runs `load`, which must throw InputError whose message contains every one of `parts`.
inline void expect_input_error(const std::function<void()>& load, const std::vector<std::string>& parts) {
  try {
    load();
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

}  // namespace polytrain::testing
