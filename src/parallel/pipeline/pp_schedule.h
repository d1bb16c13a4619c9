// Pipeline schedules as data (torch-free, tested without a model): what each stage does in one
// step, in order, and the partition of a model's layers over the stages.
//   GPipe:        every micro-batch's forward, then every backward (Huang et al. 2019).
//   1F1B:         PipeDream-flush (Narayanan et al. 2021): stage s runs P - s - 1 warm-up
//                 forwards, then one forward and one backward in turn, then the remaining
//                 backwards; it keeps at most P - s micro-batches' activations.
//   interleaved:  Megatron's interleaved 1F1B (arXiv 2104.04473): each stage holds V model
//                 chunks (chunk g of P x V lives on stage g mod P); the bubble shrinks by V.
//   ZB-H1:        zero-bubble H1 (Qi et al. 2024, arXiv 2401.10241): each backward is split into
//                 B (the input gradients, which the previous stage waits for) and W (the weight
//                 gradients, which nobody waits for); 1F1B's order with B in place of the
//                 backward, stage s deferring up to P - s - 1 W passes into its cool-down, where
//                 1F1B idles.
// A stage runs its list in order; a forward waits for the previous chunk's activations, a
// backward for the next chunk's gradients. simulate_schedule replays the lists with fixed costs:
// the idle fraction of each stage, its peak of micro-batches in flight, and whether the lists
// can deadlock (they cannot: the test sweeps them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace polytrain {

struct PipeAction {
  bool forward = true;
  bool weight = false;  ///< ZB-H1's W pass (forward false); its B pass is then the input gradients only
  int64_t micro = 0;  ///< micro-batch of the step
  int64_t chunk = 0;  ///< this stage's model chunk (0 .. V-1); global chunk = chunk x P + stage
};

/// Why `kind` ("1f1b", "gpipe", "zbh1") cannot run P stages x V chunks over M micro-batches (one line
/// naming the keys and numbers), or "".
std::string pipeline_schedule_error(const std::string& kind, int64_t stages, int64_t virtual_stages, int64_t micro_batches);

/// Stage `stage`'s actions for one step (checks pipeline_schedule_error first).
std::vector<PipeAction> pipeline_schedule(const std::string& kind, int64_t stages, int64_t virtual_stages,
                                          int64_t micro_batches, int64_t stage);

/// Replay of every stage's list with a forward costing `forward_cost` and a backward
/// `backward_cost` per chunk (ZB-H1: half of it B, half W), communication free.
struct ScheduleReplay {
  bool deadlock = false;
  double makespan = 0;
  std::vector<double> idle_fraction;      ///< per stage: 1 - busy time / makespan
  std::vector<int64_t> peak_in_flight;    ///< per stage: most chunk forwards awaiting their backward (ZB-H1: their W)
};
ScheduleReplay simulate_schedule(const std::string& kind, int64_t stages, int64_t virtual_stages, int64_t micro_batches,
                                 double forward_cost = 1.0, double backward_cost = 2.0);

/// The idle fraction theory gives a stage: the bubble (P - 1) (t_f + t_b), divided by V when
/// interleaved (Narayanan et al. 2021, section 2.2), over the step it lengthens:
/// (P - 1) / (V M + P - 1); for 1F1B and GPipe (V = 1) (P - 1) / (M + P - 1).
double theoretical_bubble(int64_t stages, int64_t virtual_stages, int64_t micro_batches);

/// Contiguous split of `weights` (one per layer) into `parts` non-empty runs minimising the
/// heaviest run (DeepSpeed's partition_balanced): parts + 1 boundaries, first 0, last n.
std::vector<int64_t> partition_balanced(const std::vector<double>& weights, int64_t parts);

}  // namespace polytrain
