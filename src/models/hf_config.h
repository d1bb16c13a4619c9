// Reading one model family's Hugging Face config (config.json, or the `model` section of a
// polytrain config) into its typed options: HF's defaults, HF's key aliases, and an InputError
// naming the file and key for a wrong type or value. Unknown keys are kept, not errors: HF
// configs carry many (architectures, torch_dtype, task_specific_params, ...). No torch here:
// the per-family readers (*_config.cpp) are fuzzed without it (fuzz/fuzz_hf_config.cpp).
#pragma once

#include <initializer_list>
#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/error.h"

namespace polytrain {

/// The activation names models/hf_layers.h's hf_activation knows, comma-separated, for messages.
const char* hf_activation_names();
/// Whether hf_activation knows `name`.
bool is_hf_activation(const std::string& name);
/// Throws hf_activation's error for an unknown name (call at build time, not mid-run).
void check_hf_activation(const std::string& name, const char* key = "model.hidden_act");
/// Whether config.json's `architectures` list names `arch`.
bool names_architecture(const nlohmann::json& j, const std::string& arch);

class HfConfigReader {
 public:
  /// origin names the source in messages: "model" (a config section) or ".../config.json".
  HfConfigReader(const nlohmann::json& j, std::string origin) : j_(j), origin_(std::move(origin)) {
    PT_INPUT_CHECK(j_.is_object(), origin_, ": a model config must be a JSON object");
  }

  /// The value of `key` (or the first alias present), `def` when none is; null counts as absent.
  template <typename T>
  T get(const char* key, T def, std::initializer_list<const char*> aliases = {}) const {
    const nlohmann::json* v = find(key, aliases);
    if (!v) return def;
    try {
      if constexpr (std::is_same_v<T, bool>) {
        if (!v->is_boolean()) throw std::invalid_argument("");
      } else if constexpr (std::is_integral_v<T>) {
        if (!v->is_number_integer()) throw std::invalid_argument("");
      } else if constexpr (std::is_floating_point_v<T>) {
        if (!v->is_number()) throw std::invalid_argument("");
      } else {
        if (!v->is_string()) throw std::invalid_argument("");
      }
      return v->get<T>();
    } catch (const std::exception&) {
      const char* expected = std::is_same_v<T, bool>           ? "true or false"
                             : std::is_integral_v<T>           ? "an integer"
                             : std::is_floating_point_v<T>     ? "a number"
                                                               : "a string";
      fail(used_key(key, aliases), std::string("must be ") + expected + ", got " + v->dump());
    }
  }

  /// get() and a check that the value is > 0.
  int64_t positive(const char* key, int64_t def, std::initializer_list<const char*> aliases = {}) const {
    const int64_t v = get<int64_t>(key, def, aliases);
    if (v <= 0) fail(used_key(key, aliases), "must be > 0, got " + std::to_string(v));
    return v;
  }

  /// get() and a check that the value lies in [0, 1).
  double probability(const char* key, double def, std::initializer_list<const char*> aliases = {}) const {
    const double v = get<double>(key, def, aliases);
    if (!(v >= 0.0 && v < 1.0)) fail(used_key(key, aliases), "must be in [0, 1), got " + std::to_string(v));
    return v;
  }

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  [[noreturn]] void fail(const std::string& key, const std::string& message) const {
    throw InputError(origin_ + ": '" + key + "' " + message);
  }

 private:
  const nlohmann::json* find(const char* key, std::initializer_list<const char*> aliases) const {
    if (has(key)) return &j_.at(key);
    for (const char* a : aliases)
      if (has(a)) return &j_.at(a);
    return nullptr;
  }
  std::string used_key(const char* key, std::initializer_list<const char*> aliases) const {
    if (has(key)) return key;
    for (const char* a : aliases)
      if (has(a)) return a;
    return key;
  }

  const nlohmann::json& j_;
  std::string origin_;
};

}  // namespace polytrain
