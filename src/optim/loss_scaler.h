// fp16 loss scaling with DeepSpeed's semantics (runtime/fp16/loss_scaler.py), torch-free.
//
//   fp16.loss_scale > 0: static, that scale for ever (an overflowing step is still skipped);
//   fp16.loss_scale 0:   dynamic, starting at 2^initial_scale_power. An overflow skips the step
//     and, once `hysteresis` overflows have used up the tolerance, divides the scale by 2 (not
//     below min_loss_scale; an overflow at min_loss_scale is an error, as in DeepSpeed). After
//     every loss_scale_window steps counted from the last overflow without one, the scale
//     doubles and the hysteresis tolerance is restored (on every good step instead with
//     consecutive_hysteresis).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace polytrain {

struct Fp16Config;

class LossScaler {
 public:
  /// `max_scale`: the dynamic scale never grows above it (Apex's max_loss_scale; DeepSpeed has none).
  explicit LossScaler(const Fp16Config& cfg, double max_scale = std::numeric_limits<double>::infinity());

  double scale() const { return cur_scale_; }
  bool dynamic() const { return dynamic_; }
  int hysteresis_left() const { return cur_hysteresis_; }

  /// Records one optimizer step (`overflow`: its gradients were not finite, so it was
  /// skipped). Returns what changed, for the log ("" when nothing worth a line did). Throws
  /// Error when a dynamic scale already at min_loss_scale overflows again.
  std::string update(bool overflow);

  nlohmann::json state() const;
  /// InputError naming the bad field when `state` is not what state() writes.
  void load_state(const nlohmann::json& state);

 private:
  bool dynamic_;
  double cur_scale_;
  double min_scale_;
  double max_scale_;
  int64_t scale_window_;
  int delayed_shift_;
  bool consecutive_hysteresis_;
  int cur_hysteresis_;
  int64_t cur_iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace polytrain
