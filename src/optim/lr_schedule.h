// Learning-rate (and OneCycle momentum) schedules with DeepSpeed's names, parameters and values,
// as pure functions of the optimizer-update index. Applying them to an optimizer
// (set_learning_rate / set_beta1 in optimizers.h) and counting updates is the Trainer's job.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

namespace polytrain {

struct SchedulerConfig;

/// A schedule maps the index of an optimizer update to the LR it runs with.
///
/// Index <-> DeepSpeed: DeepSpeed builds the scheduler with last_batch_iteration = -1, and its
/// constructor writes an initial LR into the optimizer; engine._take_model_step calls
/// lr_scheduler.step() (last_batch_iteration += 1) right *after* each applied optimizer.step()
/// and not after an fp16-overflow skip. So update `step` (0-based, counting applied updates)
/// runs with DeepSpeed's last_batch_iteration == step - 1, and step 0 runs with the
/// constructor's values. Those are what the formula at iteration -1 gives, except:
///  - WarmupCosineLR: step 0 has LR 0 (DeepSpeed's "not started" value, written to group 0);
///  - OneCycle with cycle_momentum: step 0 has momentum cycle_min_mom (the constructor's),
///    from step 1 on the formula (which starts near cycle_max_mom).
/// Not reproduced: OneCycle with cycle_momentum also sets Adam's beta2 to 0.99 in DeepSpeed;
/// momentum() reports beta1 only. cycle_first/second_stair_count are accepted and, as in
/// DeepSpeed, unused by any formula.
class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  /// LR for the optimizer update with 0-based index `step` (the first update is step 0).
  virtual double lr(int64_t step) const = 0;
  /// Momentum (beta1) for that update when the schedule cycles momentum (OneCycle), else nullopt.
  virtual std::optional<double> momentum(int64_t step) const { return std::nullopt; }
};

/// Builds the schedule named by cfg.type: "" (constant base_lr), WarmupLR, WarmupDecayLR,
/// WarmupCosineLR, OneCycle, LRRangeTest. `base_lr` is the optimizer's configured LR; only
/// "" and WarmupCosineLR (which scales it) read it, the others set absolute LRs as in
/// DeepSpeed. Throws InputError naming the scheduler.params key for values DeepSpeed would
/// crash on or silently replace (unknown type or warmup_type, zero step sizes, ...).
std::unique_ptr<LrSchedule> make_lr_schedule(const SchedulerConfig& cfg, double base_lr);

}  // namespace polytrain
