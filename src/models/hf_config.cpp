// The torch-free helpers of models/hf_config.h.
#include "polytrain/models/hf_config.h"

namespace polytrain {

const char* hf_activation_names() {
  return "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, silu, swish, tanh";
}

bool is_hf_activation(const std::string& a) {
  return a == "gelu" || a == "gelu_new" || a == "gelu_pytorch_tanh" || a == "gelu_fast" || a == "relu" ||
         a == "silu" || a == "swish" || a == "tanh";
}

void check_hf_activation(const std::string& name, const char* key) {
  PT_INPUT_CHECK(is_hf_activation(name), key, ": unsupported activation '", name, "' (supported: ",
                 hf_activation_names(), ")");
}

bool names_architecture(const nlohmann::json& j, const std::string& arch) {
  auto it = j.find("architectures");
  if (it == j.end() || !it->is_array()) return false;
  for (const auto& a : *it)
    if (a.is_string() && a.get<std::string>() == arch) return true;
  return false;
}

}  // namespace polytrain
