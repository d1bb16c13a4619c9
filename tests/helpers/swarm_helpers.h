// Test helpers shared by the swarm tests: polling for a condition with a deadline, and an
// averaging group made of in-process peers.
#pragma once

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/swarm/butterfly.h"

namespace polytrain::testing {

/// Waits up to `limit` for cond(), polling every `poll`; the last answer of cond().
template <typename F>
bool eventually(F cond, std::chrono::milliseconds limit, std::chrono::milliseconds poll = std::chrono::milliseconds(20)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(poll);
  }
  return cond();
}

/// A group `id` of every peer (anything with address()), named peer0, peer1, ..., bandwidth 1.
template <typename Peer>
hivemind::Group group_of(const std::vector<std::unique_ptr<Peer>>& peers, const std::string& id) {
  hivemind::Group g;
  g.group_id = id;
  for (size_t i = 0; i < peers.size(); ++i) g.members.push_back({"peer" + std::to_string(i), peers[i]->address(), 1.0});
  return g;
}

/// The model weights a run named `name` saved under `dir` at global step `step`
/// (save_safetensors), by parameter name.
inline std::map<std::string, at::Tensor> saved_weights(const std::filesystem::path& dir, const std::string& name,
                                                       int64_t step) {
  std::map<std::string, at::Tensor> m;
  for (auto& [k, v] : load_safetensors((dir / name / ("global_step" + std::to_string(step)) / "model.safetensors").string()))
    m[k] = v;
  return m;
}

}  // namespace polytrain::testing
