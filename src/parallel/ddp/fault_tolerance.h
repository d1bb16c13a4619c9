// Fault-tolerant data parallelism (trainer.fault_tolerance, docs/fault_tolerance.md): when a
// collective fails because ranks are gone, the survivors agree on who is left through the
// rendezvous store (a quorum under a new key prefix per membership generation), build a new Gloo
// group among themselves and redo the interrupted step over the same global batch. Ranks keep
// their original number as their identity ("member"): member m's micro-batches are always the
// same samples with the same dropout draws, whoever runs them, so a lost member's micro-batches
// run as extra micro-batches on the survivors and the step is the uninterrupted one's within
// float rounding.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "polytrain/parallel/comm/gloo_communicator.h"

namespace polytrain {

/// One micro-batch of a step's global batch: micro-batch `index` of original member `member`.
struct MicroBatchSlot {
  int64_t member = 0;
  int64_t index = 0;
};

/// What a regroup decided.
struct MembershipChange {
  std::vector<int64_t> left;     ///< original ranks that left in this change
  std::vector<int64_t> members;  ///< original ranks that go on, in their new rank order
  int64_t generation = 0;        ///< 1 for the first change
};

/// What a backend that survives lost ranks offers the training loop.
class ElasticGroup {
 public:
  virtual ~ElasticGroup() = default;
  /// After a collective of the step after `step` failed with a CommFailure: drops the broken
  /// group, agrees with the survivors on the new membership and connects it. InputError below
  /// trainer.fault_tolerance.min_world_size (naming the lost ranks); Error when no quorum can be
  /// held (the rendezvous store's host, rank 0, is gone) or the survivors stand at different steps.
  virtual MembershipChange regroup(int64_t step) = 0;
  /// This rank's micro-batches of every step, its own first (empty: the plain fixed schedule).
  virtual const std::vector<MicroBatchSlot>& plan() const = 0;
  /// Ranks at the start (each one's micro-batches are part of every global batch).
  virtual int64_t original_members() const = 0;
  /// The divisor of this rank's summed micro-batch losses before the mean over ranks makes the
  /// step's loss: its samples per step, or after a regroup global batch / ranks.
  virtual double loss_divisor() const = 0;
};

/// Member `me`'s micro-batches once `members` are left of `original` members of `accumulation`
/// micro-batches each: its own, then its share of the lost members' (dealt round-robin over
/// `members` in their order, by lost member then index).
std::vector<MicroBatchSlot> micro_batch_plan(const std::vector<int64_t>& members, int64_t original,
                                             int64_t accumulation, int64_t me);

/// The quorum of membership generation `generation`: member `me` (at optimizer step `step`)
/// registers under ft/g<generation>/, waits until every member of `previous` has registered or
/// `settle` has passed, and the first survivor to decide writes the list everyone then reads.
/// Error when this rank is not in it (it registered after the quorum closed) or the survivors
/// registered different steps.
std::vector<int64_t> agree_membership(const StoreOps& store, int64_t generation, int64_t me,
                                      const std::vector<int64_t>& previous, int64_t step,
                                      std::chrono::milliseconds settle);

/// "2" / "1, 2": original ranks as the membership lines print them.
std::string rank_list(const std::vector<int64_t>& ranks);

}  // namespace polytrain
