// env_type=hivemind: a peer of a decentralized swarm (hivemind.Optimizer's semantics). No
// fixed world, no launcher: the peer joins a DHT, accumulates micro-batches of its own data
// stream until the swarm's progress reaches hivemind.target_batch_size, then finds a group
// (matchmaking.h), averages its gradients with it weighted by samples (butterfly.h), and every
// member takes the same optimizer step: the swarm's global step ("epoch"). With averaging
// failed (alone, timed out) the peer steps on its local gradients and says so.
//
// Samples per global step: every peer announces a micro-batch before computing it (progress
// records carry samples in flight) and, before deciding on another, waits (bounded by
// request_timeout) until the peers of its last group announced theirs; the swarm therefore stops
// at the target instead of overshooting by up to a micro-batch per peer as hivemind does, and
// with every peer present each global batch is split the same way every time.
//
// Joining late, falling behind, restarting (state.h): every non-client peer announces itself as
// a state donor and, when a newcomer asks, serves a snapshot of its parameters, optimizer state
// and epoch taken between two optimizer steps (state_mu_); a peer
// that starts (or resumes) behind the swarm, that finds the swarm's round for its epoch already
// over, or that ends a step more than one epoch behind, loads the newest state from several
// donors at once instead of stepping.
//
// Auxiliary peers (hivemind.assist_in_averaging: RuLeanALBERT's run_aux_peer.py, hivemind's
// Optimizer(auxiliary=True)): a peer that trains nothing. Its model only gives the shapes of
// what the swarm averages. It follows the swarm's epochs through the progress records, joins
// every round (gradients, then the state round when there is one) as a member that reduces a
// share of the vector by its bandwidth and contributes nothing (weight 0, hivemind's AUX mode),
// so client-mode peers can average even when it is the only peer that accepts connections. It
// publishes no samples, no metrics and no state (its weights are never the swarm's).
//
// Local updates (hivemind.outer_optimizer, DiLoCo; local_updates.cpp): every micro-batch is an
// inner step of the trainer's optimizer on this peer's own data, with no round. Each global step
// averages the pseudo-gradients (the outer parameters minus the local ones) instead of the
// gradients, and the outer optimizer (outer_optimizer.h) steps the outer parameters, which every
// member of the group then continues from. The state a donor serves holds the outer parameters
// and outer momentum, the same on every peer; each peer's inner optimizer state stays its own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <string>
#include <vector>

#include "polytrain/parallel/replicated_backend.h"

namespace polytrain {

namespace hivemind {
class DhtNode;
class Identity;
class ProgressTracker;
class Matchmaker;
class Averager;
class Router;
class Server;
class StateDonor;
class MetricsPublisher;
struct GlobalProgress;
struct AllReduceOptions;
class OuterOptimizer;
}  // namespace hivemind

class LrSchedule;

class HivemindBackend : public ReplicatedBackend {
 public:
  explicit HivemindBackend(const Config& cfg);
  ~HivemindBackend() override;
  std::string name() const override { return "hivemind"; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  DataShard data_shard() const override;
  int64_t global_batch() const override { return h_.target_batch_size; }
  std::string amp_refusal() const override { return "amp is not implemented for env_type hivemind; use fp16 or bf16"; }
  int64_t next_micro_batch(int64_t micro_steps_done, int64_t samples_done) const override;
  void backward(const at::Tensor& loss, const MicroStep& m) override;
  StepResult step(const StepRequest& request, int64_t step) override;
  double reduce_metric(double local_value) override { return local_value; }
  void barrier() override {}
  void set_global_step(int64_t step) override;
  int64_t catch_up(int64_t step) override;
  bool assists_only() const override { return h_.assist_in_averaging; }
  int64_t assist(int64_t step, int64_t until) override;
  /// A delayed update still running is finished (and reaches the model) first.
  NamedTensors full_state(torch::nn::Module& model) override;
  void save_shard(torch::serialize::OutputArchive& archive) override;
  /// Local updates: the outer momentum too, when the checkpoint has it.
  void load_shards(ShardReader& reader) override;

  /// This peer's DHT address (what others pass as --initial_peers) and id.
  std::string dht_address() const;
  std::string peer_id() const;

 private:
  bool known_peers_announced(int64_t epoch) const;
  /// This peer's parameters, optimizer state and epoch as bytes (what donors serve).
  std::string snapshot() const;
  void restore(const std::string& bytes, const std::string& origin);
  /// Loads the swarm's newest state from donors ahead of epoch_; false (said on stderr) when
  /// none could be loaded.
  bool reload_from_peers(const std::string& why);
  /// Says once that a peer claims an epoch the swarm does not vouch for (progress.h).
  void report_unvouched(const hivemind::GlobalProgress& g);
  /// "Collaboration accumulated N samples from P peers; ETA S seconds" at hivemind's cadence.
  void report_progress(const hivemind::GlobalProgress& g) const;
  void donate();
  /// One averaging round over `tensors` (their gradients with `grads`), ending by `round_end`
  /// (the round's averaging_timeout, matchmaking included) or allreduce_timeout, the earlier.
  /// Returns the members whose contributions it averaged in full (this peer included).
  size_t average_flat(std::vector<at::Tensor> tensors, bool grads, const void* group, double weight,
                    std::chrono::steady_clock::time_point round_end, int64_t epoch, const std::string& what);
  /// Before a parameter round's result (flat_[0..n), in `own`'s order) replaces `own`: each
  /// reducer's part that is not finite or too far from `own` (round_check.h) is reset to `own`'s
  /// values in flat_, with one line naming the reducer.
  void keep_own_where_implausible(const std::vector<at::Tensor>& own, const void* group, size_t n, int64_t epoch,
                                  const std::string& what);
  /// Timeouts and bounds of a gradient (`grads`) or state round ending by `round_end`.
  hivemind::AllReduceOptions allreduce_options(bool grads, std::chrono::steady_clock::time_point round_end,
                                               int64_t epoch) const;
  /// An auxiliary peer's share of one round: reduces its part of `n` elements (nothing of its
  /// own goes in) and says so in one line; false when it reduced nothing.
  bool assist_round(const void* group, size_t n, bool grads, std::chrono::steady_clock::time_point round_end,
                    int64_t epoch, const std::string& what);
  /// The state round: the parameters the optimizer steps (the offloaded copy with
  /// offload_optimizer) and the average_opt_statistics of each, ending by `round_end`.
  void average_state(const void* group, std::chrono::steady_clock::time_point round_end, int64_t epoch);
  /// delay_optimizer_step: waits for the update running in the background, rethrows its
  /// failure, and copies its result into the model. Nothing when none is in flight.
  void finish_update();

  // The phases of step(), in order.
  struct StepRound;
  /// Makes the gradient this peer's mean over its `local` samples (the loop normalised it by one micro-batch).
  void scale_to_local_mean(int64_t local);
  /// Drops this peer's progress and loads the swarm's state into `r`; false when that load failed.
  bool rejoin(const StepRound& round, StepResult* r);
  /// rejoin() when the swarm is past the round's epoch and no trainer peer is left at it.
  bool rejoin_if_alone(const StepRound& round, StepResult* r);
  /// Matchmaking for the round's gradient group (round.group; round.moved_on when the swarm moved past it).
  void find_gradient_group(StepRound& round);
  /// The gradient round with round.group (or a warning without one); returns the members averaged.
  size_t average_gradients(const StepRound& round);
  /// Sets round.state when this step also averages the state (every average_state_every epochs).
  void plan_state_round(StepRound& round);
  /// delay_optimizer_step: decides the skip, advances the epoch and starts the update in the background.
  StepResult update_in_background(const StepRequest& request, int64_t step, const StepRound& round);
  /// The update and the state round under state_mu_, then the next epoch.
  StepResult update_now(const StepRequest& request, int64_t step, const StepRound& round);
  /// Follows the swarm into the next epoch (reloading or jumping ahead when it is further) and announces it.
  void enter_next_epoch();
  /// Posts this peer's share of the global step (loss, samples, speed) for monitors.
  void post_metrics(const StepRequest& request, const StepRound& round);
  /// Fills flat_[0, n) from `tensors` (their gradients with `grads`); returns n.
  int64_t fill_flat(const std::vector<at::Tensor>& tensors, bool grads);
  /// The all-reduce of flat_[0, n) with `group`: counts its bytes, says its warning, returns the
  /// members whose contributions it averaged in full (this peer included).
  size_t allreduce_flat(int64_t n, bool grads, const void* group, double weight,
                        std::chrono::steady_clock::time_point round_end, int64_t epoch, const std::string& what);

  // Local updates (local_updates.cpp); all of them do nothing without hivemind.outer_optimizer.
  /// Reads hivemind.outer_optimizer from the config as given and refuses what it cannot go with.
  void configure_local_updates(const Config& cfg);
  /// The outer parameters from the model, the fresh inner optimizer whose state donors serve.
  void prepare_local_updates(const Config& cfg);
  /// What the optimizer steps: the offloaded copy with offload_optimizer, else the parameters.
  const std::vector<at::Tensor>& held() const { return masters_.empty() ? params_ : masters_; }
  /// One inner step of the trainer's optimizer on the micro-batch whose backward just ran.
  void inner_step(int64_t samples);
  /// The outer step with the pseudo-gradient averaged into flat_ (this peer's own without a
  /// group); every held tensor takes the outer parameters. Ends epoch `epoch`, to which this peer
  /// gave `local` samples; says so in one line.
  StepResult outer_update(int64_t step, int64_t epoch, int64_t local);
  /// The model's state with the outer parameters in place of the trainable ones.
  NamedTensors outer_state() const;
  /// The optimizer part of a donated state: a fresh inner optimizer's archive and the outer momentum.
  std::string outer_optimizer_bytes() const;

  HivemindConfig h_;
  std::shared_ptr<const hivemind::Identity> identity_;
  std::unique_ptr<hivemind::DhtNode> dht_;
  std::unique_ptr<hivemind::Averager> averager_;
  std::unique_ptr<hivemind::Router> router_;
  std::unique_ptr<hivemind::Matchmaker> matchmaker_;
  std::unique_ptr<hivemind::Server> server_;
  std::unique_ptr<hivemind::ProgressTracker> tracker_;
  std::unique_ptr<hivemind::StateDonor> donor_;  ///< null in client mode
  std::unique_ptr<hivemind::MetricsPublisher> metrics_;  ///< `metrics` records for monitors
  std::string config_json_;  ///< the settings the swarm shares (model, optimizer, ...), served with the state
  at::Tensor loss_sum_;  ///< sum of what backward() received this step (scaled; no host sync per micro-batch)
  mutable int64_t mini_steps_ = 0;
  std::string address_;  ///< averaging address announced in groups ("" in client mode)
  int64_t epoch_ = 0;
  // Accumulation of the current global step (next_micro_batch is const for the loop).
  mutable int64_t accounted_ = 0;  ///< samples whose backward ran this step
  mutable std::chrono::steady_clock::time_point micro_start_{};
  mutable int64_t swarm_samples_ = 0;  ///< the swarm's samples when this peer stopped accumulating
  mutable double next_progress_line_ = 0.0;  ///< Unix seconds: the next progress line is due
  int64_t contributed_ = 0;  ///< this peer's samples in the global steps it took (StepResult::contributed_samples)
  std::set<std::string> known_peers_;  ///< peers expected to announce in this epoch
  bool stepped_ = false;               ///< a global step was taken since the start
  bool reported_claim_ = false;        ///< an unvouched epoch claim was reported
  /// Averaging bytes since the last step's record (a background round adds to them).
  std::atomic<int64_t> sent_bytes_{0}, received_bytes_{0};
  at::Tensor flat_;                    ///< CPU float32 staging for averaging
  /// Held while the parameters, optimizer state or epoch change; a donor's snapshot takes it.
  mutable std::mutex state_mu_;
  /// delay_optimizer_step: the update (and state round) of the last global step runs here while
  /// the next micro-batches compute; update_pending_ (under state_mu_, with state_cv_) keeps
  /// donors from serving a state whose epoch is ahead of its optimizer step.
  std::thread pending_;
  std::atomic<bool> pending_done_{false};
  std::exception_ptr pending_error_;
  bool update_pending_ = false;
  std::condition_variable state_cv_;
  /// Local updates: null without hivemind.outer_optimizer.
  std::unique_ptr<hivemind::OuterOptimizer> outer_;
  std::unique_ptr<LrSchedule> inner_schedule_;  ///< the inner steps' lr: the trainer's schedule at the epoch
  std::unique_ptr<Optimizer> fresh_inner_;      ///< never stepped: the inner state a donor serves
  nlohmann::json outer_json_;                   ///< hivemind.outer_optimizer as given (served with the state)
};

}  // namespace polytrain
