// DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py) as closed forms of the update
// index; see lr_schedule.h for how the index maps to DeepSpeed's last_batch_iteration.
// Golden values: scripts/gen_golden_lr.py -> tests/golden/lr_schedules.json.
#include "polytrain/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace {

constexpr double kPi = 3.14159265358979323846;

enum class WarmupType { kLog, kLinear };

WarmupType parse_warmup_type(const SchedulerConfig& cfg) {
  if (cfg.warmup_type == "log") return WarmupType::kLog;
  if (cfg.warmup_type == "linear") return WarmupType::kLinear;
  throw InputError(detail::cat("scheduler.params.warmup_type: '", cfg.warmup_type, "' for ", cfg.type,
                               " is not one of 'log', 'linear'"));
}

/// Fraction of the warmup done at DeepSpeed iteration `it` (0 <= it < warmup_steps).
double warmup_fraction(int64_t it, int64_t warmup_steps, WarmupType type) {
  if (type == WarmupType::kLog)
    return (1.0 / std::log(static_cast<double>(warmup_steps))) * std::log(static_cast<double>(it + 1));
  return static_cast<double>(it) / static_cast<double>(warmup_steps);
}

class ConstantLr : public LrSchedule {
 public:
  explicit ConstantLr(double lr) : lr_(lr) {}
  double lr(int64_t) const override { return lr_; }

 private:
  double lr_;
};

/// WarmupLR (total_steps_ unset) and WarmupDecayLR: min -> max over the warmup (log or linear),
/// then hold at max, or decay linearly to 0 at total_num_steps.
class WarmupLr : public LrSchedule {
 public:
  WarmupLr(const SchedulerConfig& cfg, std::optional<int64_t> total_steps)
      : min_lr_(cfg.warmup_min_lr),
        delta_lr_(cfg.warmup_max_lr - cfg.warmup_min_lr),
        warmup_steps_(std::max<int64_t>(2, cfg.warmup_num_steps)),  // DeepSpeed: log(1) = 0
        type_(parse_warmup_type(cfg)),
        total_steps_(total_steps) {}

  double lr(int64_t step) const override {
    const int64_t it = step - 1;
    if (it < 0) return min_lr_;
    return min_lr_ + delta_lr_ * gamma(it);
  }

 private:
  double gamma(int64_t it) const {
    if (it < warmup_steps_) return warmup_fraction(it, warmup_steps_, type_);
    if (!total_steps_) return 1.0;
    const double left = static_cast<double>(*total_steps_ - it);
    const double span = std::max(1.0, static_cast<double>(*total_steps_ - warmup_steps_));
    return std::max(0.0, left / span);
  }

  double min_lr_;
  double delta_lr_;
  int64_t warmup_steps_;
  WarmupType type_;
  std::optional<int64_t> total_steps_;
};

/// WarmupCosineLR: ratio of the optimizer's LR; warmup_min_ratio -> 1 over the warmup, then a
/// cosine to cos_min_ratio at total_num_steps. Past the total the cosine continues (rises
/// again), as in DeepSpeed.
class WarmupCosineLr : public LrSchedule {
 public:
  WarmupCosineLr(const SchedulerConfig& cfg, double base_lr)
      : base_lr_(base_lr),
        total_steps_(cfg.total_num_steps),
        warmup_steps_(std::max<int64_t>(2, cfg.warmup_num_steps)),
        warmup_min_ratio_(cfg.warmup_min_ratio),
        cos_min_ratio_(cfg.cos_min_ratio),
        type_(parse_warmup_type(cfg)) {
    PT_INPUT_CHECK(total_steps_ != warmup_steps_, "scheduler.params.total_num_steps (", total_steps_,
                   ") must differ from warmup_num_steps (", warmup_steps_,
                   " after DeepSpeed's minimum of 2) for WarmupCosineLR: the cosine phase would be empty");
  }

  double lr(int64_t step) const override {
    const int64_t it = step - 1;
    if (it < 0) return 0.0;  // DeepSpeed's "not started" ratio
    return base_lr_ * ratio(it);
  }

 private:
  double ratio(int64_t it) const {
    if (it < warmup_steps_) {
      const double r = warmup_fraction(it, warmup_steps_, type_);
      return warmup_min_ratio_ + r * (1.0 - warmup_min_ratio_);
    }
    const double done = static_cast<double>(it - warmup_steps_ + 1);
    const double span = static_cast<double>(total_steps_ - warmup_steps_);
    const double r = (1 + std::cos(kPi * done / span)) / 2;
    return std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * r);
  }

  double base_lr_;
  int64_t total_steps_;
  int64_t warmup_steps_;
  double warmup_min_ratio_;
  double cos_min_ratio_;
  WarmupType type_;
};

/// OneCycle (1cycle policy, Smith 2018): a triangle min -> max -> min over
/// first + second step sizes, momentum moving inversely; then the LR decays as
/// min / (1 + rate * t / decay_step_size) and momentum grows as max * (1 + rate * t / size).
class OneCycle : public LrSchedule {
 public:
  explicit OneCycle(const SchedulerConfig& cfg) : cfg_(cfg) {
    PT_INPUT_CHECK(cfg.cycle_first_step_size > 0, "scheduler.params.cycle_first_step_size must be > 0, got ",
                   cfg.cycle_first_step_size);
    const int64_t second = cfg.cycle_second_step_size.value_or(cfg.cycle_first_step_size);
    PT_INPUT_CHECK(second >= 0, "scheduler.params.cycle_second_step_size must be >= 0, got ", second);
    PT_INPUT_CHECK(cfg.decay_step_size >= 0, "scheduler.params.decay_step_size must be >= 0, got ",
                   cfg.decay_step_size);
    const double first = static_cast<double>(cfg.cycle_first_step_size);
    total_size_ = first + static_cast<double>(second);
    step_ratio_ = first / total_size_;
    skip_lr_decay_ = cfg.decay_step_size == 0 || cfg.decay_lr_rate == 0.0;
    skip_mom_decay_ = cfg.decay_step_size == 0 || cfg.decay_mom_rate == 0.0;
  }

  double lr(int64_t step) const override {
    const int64_t it = step - 1;
    if (static_cast<double>(it) < total_size_)
      return cfg_.cycle_min_lr + (cfg_.cycle_max_lr - cfg_.cycle_min_lr) * scale(it);
    if (skip_lr_decay_) return cfg_.cycle_min_lr;
    return cfg_.cycle_min_lr / (1 + cfg_.decay_lr_rate * decay_interval(it));
  }

  std::optional<double> momentum(int64_t step) const override {
    if (!cfg_.cycle_momentum) return std::nullopt;
    const int64_t it = step - 1;
    if (it < 0) return cfg_.cycle_min_mom;  // DeepSpeed's constructor writes the *min* momentum
    if (static_cast<double>(it) < total_size_)
      return cfg_.cycle_max_mom - (cfg_.cycle_max_mom - cfg_.cycle_min_mom) * scale(it);
    if (skip_mom_decay_) return cfg_.cycle_max_mom;
    return cfg_.cycle_max_mom * (1 + cfg_.decay_mom_rate * decay_interval(it));
  }

 private:
  /// Position in the triangle, 0 at the ends and 1 at the peak; DeepSpeed evaluates it at it + 1.
  double scale(int64_t it) const {
    const double bi = static_cast<double>(it + 1);
    const double cycle = std::floor(1 + bi / total_size_);
    const double x = 1. + bi / total_size_ - cycle;
    if (x <= step_ratio_) return x / step_ratio_;
    return (x - 1) / (step_ratio_ - 1);
  }

  double decay_interval(int64_t it) const {
    return (static_cast<double>(it) - total_size_ + 1) / static_cast<double>(cfg_.decay_step_size);
  }

  SchedulerConfig cfg_;
  double total_size_ = 0;
  double step_ratio_ = 0;
  bool skip_lr_decay_ = true;
  bool skip_mom_decay_ = true;
};

/// LRRangeTest: min_lr * (1 + rate * (it + 1) / step_size), floored to whole intervals when
/// staircase is set.
class LrRangeTest : public LrSchedule {
 public:
  explicit LrRangeTest(const SchedulerConfig& cfg)
      : min_lr_(cfg.lr_range_test_min_lr),
        step_size_(cfg.lr_range_test_step_size),
        step_rate_(cfg.lr_range_test_step_rate),
        staircase_(cfg.lr_range_test_staircase) {
    PT_INPUT_CHECK(step_size_ > 0, "scheduler.params.lr_range_test_step_size must be > 0, got ", step_size_);
  }

  double lr(int64_t step) const override {
    const int64_t it = step - 1;
    double interval = static_cast<double>(it + 1) / static_cast<double>(step_size_);
    if (staircase_) interval = std::floor(interval);
    return min_lr_ * (1 + step_rate_ * interval);
  }

 private:
  double min_lr_;
  int64_t step_size_;
  double step_rate_;
  bool staircase_;
};

}  // namespace

std::unique_ptr<LrSchedule> make_lr_schedule(const SchedulerConfig& cfg, double base_lr) {
  if (cfg.type.empty()) return std::make_unique<ConstantLr>(base_lr);
  if (cfg.type == "WarmupLR") return std::make_unique<WarmupLr>(cfg, std::nullopt);
  if (cfg.type == "WarmupDecayLR" || cfg.type == "WarmupCosineLR") {
    PT_INPUT_CHECK(cfg.total_num_steps > 0, "scheduler.params.total_num_steps must be > 0 for ", cfg.type,
                   ", got ", cfg.total_num_steps);
    if (cfg.type == "WarmupDecayLR") return std::make_unique<WarmupLr>(cfg, cfg.total_num_steps);
    return std::make_unique<WarmupCosineLr>(cfg, base_lr);
  }
  if (cfg.type == "OneCycle") return std::make_unique<OneCycle>(cfg);
  if (cfg.type == "LRRangeTest") return std::make_unique<LrRangeTest>(cfg);
  throw InputError(detail::cat("scheduler.type: unknown scheduler '", cfg.type,
                               "' (known: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)"));
}

}  // namespace polytrain
