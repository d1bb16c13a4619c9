#include "polytrain/optim/loss_scaler.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace {
constexpr double kScaleFactor = 2.0;  // DeepSpeed's scale_factor (not a config key)

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}
}  // namespace

LossScaler::LossScaler(const Fp16Config& cfg, double max_scale)
    : dynamic_(cfg.loss_scale == 0.0),
      cur_scale_(dynamic_ ? std::ldexp(1.0, cfg.initial_scale_power) : cfg.loss_scale),
      min_scale_(cfg.min_loss_scale),
      max_scale_(max_scale),
      scale_window_(cfg.loss_scale_window),
      delayed_shift_(cfg.hysteresis),
      consecutive_hysteresis_(cfg.consecutive_hysteresis),
      cur_hysteresis_(cfg.hysteresis) {}

std::string LossScaler::update(bool overflow) {
  std::string what;
  if (!dynamic_) {
    if (overflow) what = "fp16 overflow, update skipped (static loss scale " + num(cur_scale_) + ")";
  } else if (overflow) {
    if (delayed_shift_ == 1 || cur_hysteresis_ == 1) {
      if (cur_scale_ == min_scale_)
        throw Error("fp16 overflow with the loss scale already at min_loss_scale " + num(min_scale_) +
                    ": cannot lower it further (DeepSpeed stops here too); lower the learning rate or use bf16");
      const double next = std::max(cur_scale_ / kScaleFactor, min_scale_);
      what = "fp16 overflow, update skipped; loss scale " + num(cur_scale_) + " -> " + num(next);
      cur_scale_ = next;
    } else {
      what = "fp16 overflow, update skipped; loss scale " + num(cur_scale_) + " kept, hysteresis " +
             std::to_string(cur_hysteresis_) + " -> " + std::to_string(cur_hysteresis_ - 1);
      --cur_hysteresis_;
    }
    last_overflow_iter_ = cur_iter_;
  } else {
    if (consecutive_hysteresis_) cur_hysteresis_ = delayed_shift_;
    if ((cur_iter_ - last_overflow_iter_) % scale_window_ == 0) {
      if (!consecutive_hysteresis_) cur_hysteresis_ = delayed_shift_;
      cur_scale_ = std::min(cur_scale_ * kScaleFactor, max_scale_);
    }
  }
  ++cur_iter_;
  return what;
}

nlohmann::json LossScaler::state() const {
  return {{"dynamic", dynamic_},
          {"cur_scale", cur_scale_},
          {"cur_iter", cur_iter_},
          {"last_overflow_iter", last_overflow_iter_},
          {"cur_hysteresis", cur_hysteresis_}};
}

void LossScaler::load_state(const nlohmann::json& s) {
  const auto field = [&](const char* key) -> const nlohmann::json& {
    PT_INPUT_CHECK(s.is_object() && s.contains(key) && s[key].is_number(), "loss scaler state: '", key,
                   "' is missing or not a number");
    return s[key];
  };
  const double scale = field("cur_scale").get<double>();
  PT_INPUT_CHECK(std::isfinite(scale) && scale > 0, "loss scaler state: cur_scale ", scale, " is not a positive number");
  // A checkpoint of a static run resumed with a dynamic config (or back) keeps the config's mode.
  if (s.value("dynamic", dynamic_) != dynamic_) return;
  cur_scale_ = scale;
  cur_iter_ = field("cur_iter").get<int64_t>();
  last_overflow_iter_ = field("last_overflow_iter").get<int64_t>();
  cur_hysteresis_ = field("cur_hysteresis").get<int>();
}

}  // namespace polytrain
