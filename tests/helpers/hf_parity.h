// Test helper: runs scripts/hf_parity.py (the plain-PyTorch reference of each HF model family,
// on Debian's python3-torch) on a model directory and inputs, and returns its outputs.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "helpers/process.h"
#include "models/safetensors.h"

namespace polytrain::testing {

/// True when /usr/bin/python3 can import torch (tests GTEST_SKIP otherwise).
inline bool python_torch_available() {
  std::string out;
  return ::access("/usr/bin/python3", X_OK) == 0 &&
         run_command("/usr/bin/python3 -c 'import torch' 2>/dev/null", &out) == 0;
}

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
