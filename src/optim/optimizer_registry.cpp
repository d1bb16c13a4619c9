// The registry table (see optimizer_registry.h).
#include "polytrain/optim/optimizer_registry.h"

#include <algorithm>
#include <cctype>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/optim/optimizers_8bit.h"

namespace polytrain {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::vector<std::string> adam_statistics(const OptimizerConfig& cfg) {
  if (cfg.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}
std::vector<std::string> moments(const OptimizerConfig&) { return {"exp_avg", "exp_avg_sq"}; }
std::vector<std::string> sgd_statistics(const OptimizerConfig& cfg) {
  return cfg.momentum > 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
}
std::vector<std::string> adagrad_statistics(const OptimizerConfig&) { return {"sum"}; }

}  // namespace

const std::vector<OptimizerEntry>& optimizer_registry() {
  //  name       statistics          shardable has_beta1 factory
  static const std::vector<OptimizerEntry> table = {
      {"Adam", adam_statistics, true, true, make_adam_optimizer},
      {"AdamW", adam_statistics, true, true, make_adam_optimizer},
      {"CPUAdam", moments, true, true, make_cpu_adam},
      {"Lamb", moments, false, true, make_lamb_optimizer, "LAMB's trust ratio needs whole parameters"},
      {"Adam8bit", moments, true, true, make_adam_8bit},
      {"AdamW8bit", moments, true, true, make_adam_8bit},
      {"LAMB8bit", moments, false, true, make_lamb_8bit, "LAMB's trust ratio needs whole parameters"},
      {"SGD", sgd_statistics, false, false, make_sgd_optimizer, "ZeRO partitions Adam/AdamW state; use Adam or AdamW"},
      {"Adagrad", adagrad_statistics, false, false, make_adagrad_optimizer,
       "ZeRO partitions Adam/AdamW state; use Adam or AdamW"},
  };
  return table;
}

const OptimizerEntry* find_optimizer(const std::string& type) {
  const std::string t = lower(type);
  for (const auto& e : optimizer_registry())
    if (lower(e.name) == t) return &e;
  return nullptr;
}

const OptimizerEntry& optimizer_entry(const std::string& type) {
  if (const OptimizerEntry* e = find_optimizer(type)) return *e;
  std::string known;
  for (const auto& e : optimizer_registry()) known += (known.empty() ? "" : ", ") + std::string(e.name);
  throw InputError("optimizer.type: unknown optimizer '" + type + "' (known: " + known + ")");
}

}  // namespace polytrain
