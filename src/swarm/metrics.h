// The swarm's training metrics (hivemind's LocalMetrics records and the collaborative recipe's
// monitor), no torch.
//
// After each global step a trainer peer publishes one `metrics` record under
// `{run_id}_metrics` (its slot: a newer record replaces the older). The record holds the peer's
// last kMetricsHistory steps, each with the step it completed, the mean loss over its own
// samples of that step, its samples, its throughput and micro-batches: a monitor that polls
// less often than the swarm steps (or a publisher whose store took longer than a step) still
// sees every step. A monitor polls the key, gathers the records of each step as they appear and,
// once the step is over, logs the swarm's view of it: the sample-weighted loss (the loss of
// the global batch), the peers that took part, their samples and summed samples/s.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace polytrain::hivemind {

class DhtNode;

/// One peer's metrics of one global step.
struct StepMetrics {
  int64_t step = 0;                 ///< the global step completed (the swarm's epoch after it)
  double loss = 0.0;                ///< mean over this peer's samples of the step
  int64_t samples = 0;              ///< this peer's samples in the step
  double samples_per_second = 0.0;  ///< this peer's throughput (moving average)
  int64_t mini_steps = 0;           ///< its micro-batches
  double time = 0.0;                ///< Unix seconds when published
};
/// Steps one record carries (the newest last); 8 fit the DHT's payload limit with room to spare.
constexpr size_t kMetricsHistory = 8;
/// One record: [time, [[step, loss, samples, samples/s, micro-batches], ...]], the time of the
/// newest entry; at most kMetricsHistory entries (the newest are kept).
std::string encode_metrics(const std::vector<StepMetrics>& recent);
/// nullopt for anything but a well-formed metrics payload (1 to kMetricsHistory entries,
/// steps increasing, finite numbers, counts >= 0). Every entry gets the record's time.
std::optional<std::vector<StepMetrics>> decode_metrics(const std::string& payload);

/// Publishes a peer's metrics from a thread of its own, so a step never waits for the DHT:
/// post() adds a step to the history, and the loop stores the newest history.
class MetricsPublisher {
 public:
  MetricsPublisher(DhtNode& dht, std::string key, std::chrono::milliseconds ttl);
  ~MetricsPublisher();  ///< sends what is pending first (bounded by the store's 1 s deadline)
  void post(const StepMetrics& m);
  uint64_t published() const;

 private:
  void loop();
  DhtNode& dht_;
  std::string key_;
  std::chrono::milliseconds ttl_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<StepMetrics> recent_;  ///< the last kMetricsHistory steps posted
  bool pending_ = false;             ///< a step posted since the last store
  bool stop_ = false;
  uint64_t published_ = 0;
  std::thread thread_;
};

/// The swarm's view of one global step.
struct SwarmStep {
  int64_t step = 0;
  double loss = 0.0;  ///< sample-weighted mean of the peers' losses
  int64_t alive_peers = 0;
  int64_t samples = 0;
  double samples_per_second = 0.0;
  int64_t mini_steps = 0;
};

/// Gathers the peers' records step by step (pure: the caller supplies records and time). A
/// step is final once a newer step was seen and nothing new arrived for it during `grace`
/// seconds, or once it has been quiet for `linger` seconds (the run's last step).
class SwarmMetrics {
 public:
  SwarmMetrics(double grace, double linger) : grace_(grace), linger_(linger) {}
  /// One record seen at `now` (repeats are ignored; steps already final are dropped).
  void add(const std::string& peer_id, const StepMetrics& m, double now);
  /// The steps final at `now`, oldest first; all pending ones when `flush`.
  std::vector<SwarmStep> take_final(double now, bool flush = false);
  int64_t last_final() const { return last_final_; }

 private:
  struct Pending {
    std::map<std::string, StepMetrics> peers;
    double changed = 0.0;
  };
  double grace_, linger_;
  std::map<int64_t, Pending> pending_;
  int64_t last_final_ = -1;
  int64_t newest_ = -1;
};

}  // namespace polytrain::hivemind
