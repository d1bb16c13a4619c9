// FlagAI's Trainer argument names as `trainer` keys, moved to the DeepSpeed keys they mean before
// the config is read (docs/config.md, "FlagAI names"). trainer.master_ip is a trainer key of its
// own (config_keys.h); the command-line flags of the same names are cli_config.cpp's.
#include <cmath>
#include <string>
#include <vector>

#include "polytrain/common/config_keys.h"

namespace polytrain::config_detail {

namespace {

using detail::cat;

enum class Kind { kInteger, kNumber, kBoolean };

struct FlagAiName {
  const char* name;     ///< in `trainer`
  const char* target;   ///< the DeepSpeed key, dotted
  Kind kind;
  const char* meaning;  ///< why the target, for the conflict message
};

const FlagAiName kNames[] = {
    {"batch_size", "train_micro_batch_size_per_gpu", Kind::kInteger, "FlagAI's batch_size is per process"},
    {"gradient_accumulation_steps", "gradient_accumulation_steps", Kind::kInteger, "the same setting"},
    {"lr", "optimizer.params.lr", Kind::kNumber, "FlagAI's lr is the optimizer's"},
    {"weight_decay", "optimizer.params.weight_decay", Kind::kNumber, "FlagAI's weight_decay is the optimizer's"},
    {"clip_grad", "gradient_clipping", Kind::kNumber, "FlagAI's clip_grad is the global gradient-norm clip"},
    {"fp16", "fp16.enabled", Kind::kBoolean, "FlagAI's fp16 switches DeepSpeed's fp16 block on"},
};

bool has_kind(const json& v, Kind kind) {
  switch (kind) {
    case Kind::kBoolean: return v.is_boolean();
    case Kind::kInteger: return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
    case Kind::kNumber: return v.is_number();
  }
  return false;
}

const char* kind_name(Kind kind) {
  return kind == Kind::kBoolean ? "a boolean (true/false)" : kind == Kind::kInteger ? "an integer" : "a number";
}

// The object the target key goes in, created where absent; nullptr when something that is not an
// object is in the way (the section's own reader reports that).
json* parent_of(json& doc, const std::string& dotted) {
  json* node = &doc;
  size_t start = 0;
  for (size_t dot = dotted.find('.'); dot != std::string::npos; start = dot + 1, dot = dotted.find('.', start)) {
    json& child = (*node)[dotted.substr(start, dot - start)];
    if (child.is_null()) child = json::object();
    if (!child.is_object()) return nullptr;
    node = &child;
  }
  return node;
}

// trainer.warm_up: FlagAI's fraction of the run spent warming up the learning rate. It becomes
// the scheduler's warmup_num_steps = round(warm_up x total steps), the total being
// scheduler.params.total_num_steps or else trainer.max_steps; without a scheduler, FlagAI's own
// schedule (linear warmup from 0, then linear decay to 0) as DeepSpeed's WarmupDecayLR.
void map_warm_up(json& doc, json& trainer, std::vector<std::string>& errors) {
  const json w = trainer["warm_up"];
  trainer.erase("warm_up");
  if (w.is_null()) return;
  if (!w.is_number() || !(w.get<double>() >= 0.0 && w.get<double>() <= 1.0)) {
    errors.push_back("'trainer.warm_up' must be a fraction of the run's steps in [0, 1] (FlagAI's warm_up), got " +
                     describe(w));
    return;
  }
  const double fraction = w.get<double>();
  json& sched = doc["scheduler"];
  if (!sched.is_null() && !sched.is_object()) return;  // parse_scheduler reports it
  if (sched.is_object() && sched.empty()) sched = nullptr;
  const json* type = sched.is_object() && sched.contains("type") ? &sched["type"] : nullptr;
  if (sched.is_object() && !type) return;  // params without a type: parse_scheduler reports it
  const std::string name = type && type->is_string() ? type->get<std::string>() : "";
  if (type && name != "WarmupLR" && name != "WarmupDecayLR" && name != "WarmupCosineLR") {
    if (type->is_string() && (name == "OneCycle" || name == "LRRangeTest"))
      errors.push_back("'trainer.warm_up' has no meaning for scheduler.type '" + name +
                       "' (it has no warmup phase); remove one of them, or use WarmupDecayLR");
    return;  // an unknown type is parse_scheduler's error
  }
  const json* params = sched.is_object() && sched.contains("params") ? &sched["params"] : nullptr;
  if (params && !params->is_object()) return;
  const json* total_given = params && params->contains("total_num_steps") ? &(*params)["total_num_steps"] : nullptr;
  const json* max_steps = trainer.contains("max_steps") ? &trainer["max_steps"] : nullptr;
  int64_t total = 0;
  if (total_given && total_given->is_number()) total = total_given->get<int64_t>();
  else if (max_steps && max_steps->is_number()) total = max_steps->get<int64_t>();
  if (total <= 0) {
    errors.push_back(cat("'trainer.warm_up' (", fraction, " of the run) needs the run's length in steps: give "
                         "trainer.max_steps (--max_steps N) or scheduler.params.total_num_steps"));
    return;
  }
  const int64_t steps = std::llround(fraction * static_cast<double>(total));
  if (!type) {
    const json* lr = doc.contains("optimizer") && doc["optimizer"].is_object() && doc["optimizer"].contains("params") &&
                             doc["optimizer"]["params"].is_object() && doc["optimizer"]["params"].contains("lr")
                         ? &doc["optimizer"]["params"]["lr"]
                         : nullptr;
    sched = {{"type", "WarmupDecayLR"},
             {"params", {{"warmup_min_lr", 0.0},
                         {"warmup_max_lr", lr && lr->is_number() ? *lr : json(1e-3)},  // OptimizerConfig's lr
                         {"warmup_num_steps", steps},
                         {"warmup_type", "linear"},
                         {"total_num_steps", total}}}};
    return;
  }
  json& p = sched["params"];
  if (p.is_null()) p = json::object();
  if (p.contains("warmup_num_steps") && !p["warmup_num_steps"].is_null() && p["warmup_num_steps"] != json(steps)) {
    errors.push_back(cat("'trainer.warm_up' (", fraction, " x ", total, " steps = ", steps,
                         ") and 'scheduler.params.warmup_num_steps' (", p["warmup_num_steps"].dump(),
                         ") are both given with different values; give one"));
    return;
  }
  p["warmup_num_steps"] = steps;
}

}  // namespace

void map_flagai_names(json& doc, std::vector<std::string>* errors) {
  if (!doc.is_object() || !doc.contains("trainer") || !doc["trainer"].is_object()) return;
  json& trainer = doc["trainer"];
  for (const FlagAiName& n : kNames) {
    if (!trainer.contains(n.name)) continue;
    const json v = trainer[n.name];
    const std::string from = std::string("trainer.") + n.name;
    if (v.is_null()) {
      trainer.erase(n.name);
      continue;
    }
    if (!has_kind(v, n.kind)) {
      if (!errors) continue;
      errors->push_back("'" + from + "' must be " + kind_name(n.kind) + ", got " + describe(v) + " (it means " +
                        n.target + ")");
      trainer.erase(n.name);
      continue;
    }
    const std::string target = n.target;
    json* parent = parent_of(doc, target);
    if (!parent) continue;
    const size_t dot = target.rfind('.');
    json& slot = (*parent)[dot == std::string::npos ? target : target.substr(dot + 1)];
    if (!slot.is_null() && slot != v) {
      if (!errors) continue;  // left for the parse of the whole config to report
      errors->push_back(cat("'", from, "' (", v.dump(), ") and '", target, "' (", slot.dump(),
                            ") are both given with different values; give one (", n.meaning, ")"));
      trainer.erase(n.name);
      continue;
    }
    slot = v;
    trainer.erase(n.name);
  }
  if (errors && trainer.contains("warm_up")) map_warm_up(doc, trainer, *errors);
}

}  // namespace polytrain::config_detail
