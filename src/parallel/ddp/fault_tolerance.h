// Fault-tolerant data parallelism (trainer.fault_tolerance, docs/fault_tolerance.md): when a
// collective fails because ranks are gone, the survivors agree on who is left through the
// rendezvous store (a quorum under a new key prefix per membership generation), build a new Gloo
// group among themselves and redo the interrupted step over the same global batch. Ranks keep
// their original number as their identity ("member"): member m's micro-batches are always the
// same samples with the same dropout draws, whoever runs them, so a lost member's micro-batches
// run as extra micro-batches on the survivors and the step is the uninterrupted one's within
// float rounding. A replacement that launch starts for a lost rank asks to join through the store,
// is admitted at a step boundary into a new group where it takes its old rank back, and gets the
// live state from rank 0 over that group.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
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
  std::vector<int64_t> joined;   ///< original ranks whose replacements joined in this change
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
  /// This process's rank at the start (its micro-batches' member), whatever its rank in the group now.
  virtual int64_t original_rank() const = 0;
  /// The divisor of this rank's summed micro-batch losses before the mean over ranks makes the
  /// step's loss: its samples per step, or after a regroup global batch / ranks.
  virtual double loss_divisor() const = 0;

  // Replacing a lost rank (launch restarts it with POLYTRAIN_FT_JOIN): the new process joins at
  // a step boundary and takes the live state from the group's rank 0.
  /// In a replacement: the step the group stood at when it admitted this process (it loads no
  /// checkpoint and starts after it); else -1.
  virtual int64_t joined_at() const = 0;
  /// At a step boundary (collective over the group): while ranks are missing, admits the
  /// replacements waiting in the rendezvous store (rank 0 looks, one broadcast tells the others)
  /// into a new group numbered by original rank. `joined` empty: nobody was admitted (the usual case).
  virtual MembershipChange admit(int64_t step) = 0;
  /// After an admission or a regroup (collective over the group): the members that lack the live
  /// state get it from the group's rank 0: model, optimizer, and the trainer's part (`trainer_part`
  /// is called on rank 0 only). Returns rank 0's trainer part on a rank that received the state.
  virtual bool share_live_state(const std::function<std::string()>& trainer_part, std::string* received) = 0;
};

/// What rank 0 writes to the rendezvous store for a replacement it admits (ft/join/<rank>/<attempt>).
struct Admission {
  int64_t generation = 0;
  std::vector<int64_t> members;     ///< original ranks of the new group, in rank order
  int64_t step = 0;                 ///< the step the group stands at
  std::vector<std::string> shared;  ///< what Backend::share() returned so far, in order
};

/// A replacement's request: ft/join/<me> = attempt (launch's per-rank restart count, from 1).
void request_join(const StoreOps& store, int64_t me, int64_t attempt);
/// Rank 0, while `members` are left of `original`: the attempt of each original rank's pending
/// request (-1: none), skipping those already admitted (`admitted[m]` >= the attempt).
std::vector<int64_t> pending_joins(const StoreOps& store, const std::vector<int64_t>& members, int64_t original,
                                   const std::vector<int64_t>& admitted);
/// Rank 0: tells replacement `me` (request `attempt`) it is admitted.
void write_admission(const StoreOps& store, int64_t me, int64_t attempt, const Admission& a);
/// The replacement: waits until rank 0 admits it; Error at `deadline` (the job may have ended or
/// never got back to a step boundary), CommFailure when the store is gone.
Admission await_admission(const StoreOps& store, int64_t me, int64_t attempt,
                          std::chrono::steady_clock::time_point deadline);

/// Member `me`'s micro-batches once `members` are left of `original` members of `accumulation`
/// micro-batches each: its own, then its share of the lost members' (dealt round-robin over
/// `members` in their order, by lost member then index).
std::vector<MicroBatchSlot> micro_batch_plan(const std::vector<int64_t>& members, int64_t original,
                                             int64_t accumulation, int64_t me);

/// The quorum of membership generation `generation`: member `me` (at optimizer step `step`)
/// registers under ft/g<generation>/, waits until every member of `previous` has registered or
/// `settle` has passed (for rank 0, the store's host, up to 30 s or `settle` if longer), and
/// the first survivor to decide writes the list everyone then reads.
/// Error when this rank is not in it (it registered after the quorum closed) or the survivors
/// registered different steps.
std::vector<int64_t> agree_membership(const StoreOps& store, int64_t generation, int64_t me,
                                      const std::vector<int64_t>& previous, int64_t step,
                                      std::chrono::milliseconds settle);

/// "2" / "1, 2": original ranks as the membership lines print them.
std::string rank_list(const std::vector<int64_t>& ranks);

}  // namespace polytrain
