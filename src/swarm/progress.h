// The swarm's progress toward each global batch (hivemind's ProgressTracker), no torch.
//
// Every peer publishes {epoch, samples_accumulated, samples_per_second, time, client_mode,
// samples_in_flight, auxiliary} under `{run_id}_progress` (one record per peer, replaced on each
// publish). An auxiliary peer's record (it trains nothing) only says that it will join the
// rounds of its epoch: it counts in none of the numbers below. From all the others:
//  - the global epoch is vouched for, not claimed: the highest epoch that enough of the other
//    trainers (non-client peers that have trained: samples_per_second > 0) have reached, and
//    at least our own. Enough = epoch_vouchers(m) of the m such peers: all of them up to 2,
//    then a strict majority but at least 2. So k hostile identities among them cannot move a
//    peer's epoch while k < epoch_vouchers(m); an epoch claimed by fewer is reported
//    (claimed_epoch), not adopted;
//  - and reachable: once a peer has seen the swarm (an EpochBaseline: the epoch it saw at a
//    time), a trainer whose epoch is beyond reachable_epoch() does not vote at all. The
//    throughput counts each trainer at most 4x the median's, so a minority cannot inflate it; a jump by k >= epoch_vouchers(m) identities is still bounded
//    by what the honest majority's throughput could have done. A peer resumed from a stale or
//    edited checkpoint (its real throughput, a far epoch) is refused even where it is the only
//    other trainer (m = 1);
//  - samples accumulated count only peers at that epoch;
//  - the ETA of the next epoch extrapolates each such peer's samples from its report time at
//    its throughput: remaining = target - sum(samples_i + sps_i * (now - time_i)),
//    eta = now + max(0, remaining) / sum(sps);
//  - a peer is ready to step when the target is reached, another peer is already in a later
//    epoch, or the ETA has passed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace polytrain::hivemind {

class DhtNode;

struct PeerProgress {
  int64_t epoch = 0;
  int64_t samples_accumulated = 0;
  double samples_per_second = 0.0;
  double time = 0.0;  ///< Unix seconds of the report
  bool client_mode = false;
  /// Samples of the micro-batch being computed now (announced before it starts, so that the
  /// swarm stops at its target instead of overshooting by a micro-batch per peer).
  int64_t samples_in_flight = 0;
  /// An auxiliary peer (--assist_in_averaging): trains nothing, joins each round of `epoch`
  /// to reduce a share of it; no sample, peer count, epoch vote or throughput counts it.
  bool auxiliary = false;
  std::string peer_id;  ///< the record's owner (not encoded: the signature says who)
};

std::string encode_progress(const PeerProgress& p);
/// Strict: a well-formed payload with finite, non-negative numbers, or nothing.
std::optional<PeerProgress> decode_progress(const std::string& payload);

/// How many of `m` other trainers must have reached an epoch for a peer to adopt it: m up to 2,
/// then max(2, a strict majority).
int epoch_vouchers(int m);

/// The swarm's epoch as this peer last saw it move, and when (Unix seconds); epoch < 0: not seen
/// yet (a peer joining takes the vouched epoch as it finds it).
struct EpochBaseline {
  int64_t epoch = -1;
  double time = 0.0;
};

/// The highest epoch a swarm at `base` can have reached by `now` at `samples_per_second`: one
/// epoch per target_batch_size samples, twice over (records are read late and throughputs are
/// moving averages), plus the epoch that may be ending as the baseline is taken.
int64_t reachable_epoch(const EpochBaseline& base, double samples_per_second, int64_t target_batch_size, double now);

/// The throughput a peer trusts for reachable_epoch(): the trainers' reported samples/s summed,
/// each counted at most kMaxThroughputRatio x their lower median (zeros left out), so that one
/// inflated record adds little while honest peers of different speeds still add up.
constexpr double kMaxThroughputRatio = 4.0;
double robust_throughput(std::vector<double> samples_per_second);

struct GlobalProgress {
  int64_t epoch = 0;
  int64_t claimed_epoch = 0;  ///< the highest epoch any trainer claims (> epoch: not vouched for)
  std::string claimant;       ///< the peer id of that claim
  int vouchers = 0;           ///< how many trainers had to vouch for an epoch above our own
  /// The reachable_epoch() bound applied (INT64_MAX: none, no baseline); a claim above it is a
  /// jump beyond the swarm's throughput and did not vote.
  int64_t reachable = INT64_MAX;
  int64_t samples_accumulated = 0;
  int64_t samples_reserved = 0;  ///< accumulated plus in flight, at the global epoch
  int64_t target_batch_size = 0;
  int num_peers = 0;    ///< peers with a live record (this one included), auxiliary peers not
  int num_clients = 0;
  int num_auxiliary = 0;  ///< auxiliary peers with a live record (this one included)
  double eta_next_epoch = 0.0;  ///< Unix seconds
  double samples_per_second = 0.0;  ///< the swarm's throughput: every live record's, this peer's included
  double next_fetch_time = 0.0;
  std::vector<PeerProgress> others;  ///< the other peers' records as read
};

/// The swarm's state from the records of the other peers and this one's own.
GlobalProgress aggregate_progress(const std::vector<PeerProgress>& others, const PeerProgress& self,
                                  int64_t target_batch_size, double now, double min_refresh = 0.05,
                                  double max_refresh = 5.0, const EpochBaseline& base = {});
/// The baseline after a view `g` taken at `now`: set by the first view in which another trainer
/// voted or this peer has trained itself (`self_trained`: a founder training alone has seen its
/// swarm), moved when the vouched epoch moves.
EpochBaseline advance_baseline(const EpochBaseline& base, const GlobalProgress& g, double now, bool self_trained);

/// The most samples each member may bring to an averaging round of `epoch` (its weight), read
/// from signed progress records: what a peer's record at that epoch says it accumulated (plus in
/// flight), and at most kMaxThroughputRatio x the lower median of those claims, so one inflated
/// record outweighs the others by little. A peer without such a record (none, another epoch, or no
/// samples) gets that lower median: hiding its record gains it nothing. No record at all: no bound.
/// A round clamps a larger weight to it (butterfly.h's sender_max_weight).
class SignedWeights {
 public:
  SignedWeights(const std::vector<PeerProgress>& records, int64_t epoch);
  double bound(const std::string& peer_id) const;
  /// For AllReduceOptions::sender_max_weight (a copy: it outlives this object).
  std::function<double(const std::string&)> as_function() const;

 private:
  std::map<std::string, double> claimed_;  // capped
  double typical_;
};

/// hivemind's ready_to_update_epoch, counting samples in flight as accumulated.
bool ready_to_update_epoch(const GlobalProgress& g, int64_t local_epoch, double now);

/// Unix time in seconds (double).
double unix_seconds();

/// Publishes this peer's progress and reads the swarm's, in a background thread: the record is
/// re-published after every local change (at most `min_publish_interval` apart) and every half
/// expiration; the swarm is read again at next_fetch_time or when asked.
class ProgressTracker {
 public:
  struct Options {
    std::string key;  ///< {run_id}_progress
    int64_t target_batch_size = 0;
    bool client_mode = false;
    double expiration = 60.0;  ///< seconds a record stays valid (>= 11)
    double min_publish_interval = 0.0;
    bool auxiliary = false;  ///< this peer's record says it is an auxiliary peer
  };
  ProgressTracker(DhtNode& dht, Options o, int64_t epoch);
  ~ProgressTracker();  ///< stops the thread (bounded)

  /// Adds `samples` to this epoch's local count and updates the throughput estimate.
  void report_local_step(int64_t samples, double seconds);
  /// Announces a micro-batch of `samples` about to be computed (cleared by the next
  /// report_local_step); publish_now() makes it visible before the work starts.
  void reserve(int64_t samples);
  /// Starts epoch `epoch` locally (after the global step): zero samples.
  void update_epoch(int64_t epoch);
  /// The last aggregated view (refreshed in the background); `refresh` fetches now first.
  GlobalProgress global(bool refresh = false);
  /// As global(true), waiting for the fetch no later than `until` (the last aggregate when
  /// it is not in by then).
  GlobalProgress global_by(std::chrono::steady_clock::time_point until);
  int64_t local_epoch() const;
  int64_t local_samples() const;
  /// This peer's throughput (moving average over its micro-batches).
  double samples_per_second() const;
  /// Publishes now and waits for it (tests, shutdown).
  bool publish_now();
  /// The weight bounds of a round of `epoch` from the last aggregated view and this peer's own
  /// count (see SignedWeights).
  SignedWeights signed_weights(int64_t epoch) const;

 private:
  void loop();
  PeerProgress snapshot() const;
  GlobalProgress fetch_and_aggregate();

  DhtNode& dht_;
  Options o_;
  mutable std::mutex mu_;
  std::mutex publish_mu_;  ///< one publish at a time: a later snapshot is never overwritten by an older one
  std::condition_variable cv_;
  PeerProgress local_;
  double ema_sps_ = 0.0;
  bool dirty_ = true;
  bool fetch_wanted_ = true;
  bool stop_ = false;
  double last_publish_ = 0.0;
  GlobalProgress global_;
  EpochBaseline baseline_;  ///< read and written by the thread's fetches only
  std::thread thread_;
};

}  // namespace polytrain::hivemind
