// The one interface every env_type implements (principle 1). The Trainer loop talks only to
// this; only backend_factory.cpp knows the concrete backends. One optimizer step, as the loop
// drives it:
//   while (n = next_micro_batch(m, samples)) > 0:      // fixed count, or the swarm's progress
//     read n samples of data_shard(); loss = forward;
//     backward(loss * n / samples_per_step(), {n, sync = last micro-batch})
//   step({lr, beta1, loss scale}, step)                 // reduce, norm, skip/clip, update
// and around it reduce_metric (logged numbers) and the checkpoint calls (save_shard on every
// rank, full_state for the consolidated model).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "polytrain/common/config.h"
#include "polytrain/common/torch_fwd.h"

namespace polytrain {

class ShardReader;

/// Where this process sits in the job, and what it is responsible for writing.
struct RankContext {
  int64_t rank = 0;        ///< global rank
  int64_t world_size = 1;  ///< all processes
  int64_t local_rank = 0;
  int64_t tp_rank = 0;     ///< tensor-parallel coordinate (Megatron order: TP ranks adjacent)
  int64_t tp_size = 1;
  int64_t dp_rank = 0;     ///< data-parallel coordinate: which share of each global batch it reads
  int64_t dp_size = 1;
  int64_t pp_rank = 0;     ///< pipeline stage (Megatron order: stages outermost)
  int64_t pp_size = 1;
  c10::Device device = c10::Device(c10::kCPU);
  // Roles (set by the backend; a decentralized peer holds all three for its own folder):
  bool writes_logs = true;          ///< experiment folder, metrics files, console lines
  bool writes_model = true;         ///< the consolidated model file of a checkpoint, --save_hf
  bool commits_checkpoints = true;  ///< completion marker, `latest`, pruning old checkpoints
};

/// Which samples this rank reads.
struct DataShard {
  int64_t member = 0;   ///< this rank's place among the readers of each global batch
  int64_t members = 1;  ///< readers of each global batch (the data-parallel size)
  /// No fixed world (a decentralized peer): read stream `member` of `members` disjoint
  /// streams at this rank's own pace instead of a slice of numbered global batches.
  bool own_stream = false;
  /// The seed of the sample order (0 = trainer.seed): a peer that shuffles on its own.
  uint64_t order_seed = 0;
};

/// One micro-batch as the loop hands it to backward().
struct MicroStep {
  int64_t samples = 0;  ///< samples in this micro-batch
  bool sync = true;     ///< the last micro-batch of the global batch: communicate now
};

/// What the loop asks of step().
struct StepRequest {
  double lr = 0.0;
  std::optional<double> beta1;  ///< when the schedule cycles momentum
  double loss_scale = 1.0;      ///< the fp16 loss scale the loss was multiplied by (1 otherwise)
};

enum class StepOutcome {
  kApplied,           ///< the optimizer updated the weights
  kSkippedNonFinite,  ///< non-finite gradients (an fp16 overflow): skipped on every rank
  kNoUpdate,          ///< nothing to update yet (e.g. a peer still joining its swarm)
};

/// The loop's side of one step's micro-batches, driven by the backend's schedule
/// (Backend::run_micro_batches): the loop reads the data and runs the user's forward_step, the
/// schedule decides the order of forwards and backwards.
class MicroBatchRunner {
 public:
  virtual ~MicroBatchRunner() = default;
  /// Reads the next `samples` samples of this rank's share of the step and runs forward_step on
  /// them; returns the loss to call backward on (already scaled and weighted by samples / the
  /// step's samples, so a step is the mean over its samples whatever its micro-batches).
  virtual at::Tensor forward(int64_t samples) = 0;

  // A pipeline schedule runs the model's stage plan (models/pipeline_plan.h) instead of
  // forward_step, on every stage of the same micro-batches:
  /// Reads the next `samples` samples of this rank's share of the step (counted toward the step)
  /// and returns them as the model's named inputs, on the device.
  virtual std::map<std::string, at::Tensor> read(int64_t samples);
  /// On the last stage, a micro-batch's loss as the model's last layer returned it: what
  /// forward() returns for it (recorded for the logged loss, scaled and weighted).
  virtual at::Tensor weigh(const at::Tensor& loss, int64_t samples);
  /// Runs `fn` under the loop's autocast (fp16, bf16, amp), as forward_step runs.
  virtual void autocast(const std::function<void()>& fn) { fn(); }
};

/// What step() did.
struct StepResult {
  StepOutcome outcome = StepOutcome::kApplied;
  double grad_norm = 0.0;   ///< global L2 norm of the gradients before clipping
  int64_t global_step = 0;  ///< optimizer steps of the run after this one (a swarm's may jump)
  int64_t samples = 0;      ///< samples that went into this step over all ranks
  int64_t group_size = 0;   ///< peers whose gradients this step averaged in full, this one included (hivemind; 0 elsewhere)
  /// Averaging traffic of this step (hivemind: the gradient and parameter rounds since the last
  /// step's record, a delayed round counted with the next step; -1 for a backend that does not
  /// count it).
  int64_t sent_bytes = -1, received_bytes = -1;
  /// Samples of this process's micro-batches that went into the global steps it took since it
  /// started (hivemind: "Your current contribution"); -1 for a backend that does not report it.
  int64_t contributed_samples = -1;
  bool applied() const { return outcome == StepOutcome::kApplied; }
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual const RankContext& context() const = 0;
  /// The collective library under the ranks' communicator ("gloo", "mpi", "nccl"); "" for a
  /// backend without one (one process, a swarm).
  virtual std::string comm_engine() const { return ""; }

  /// Wraps, replaces or shards the model in place and builds the optimizer over what this
  /// rank owns. Called once, before any state is loaded.
  virtual void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) = 0;

  /// Which samples this rank reads (default: slice dp_rank of dp_size of each global batch).
  virtual DataShard data_shard() const;

  /// Samples of one optimizer step over the whole job: train_batch_size, or a swarm's
  /// target_batch_size.
  virtual int64_t global_batch() const = 0;

  /// Why this backend cannot run the `amp` block's master-weight plans (O2 / O3), or "" when it
  /// can (the loop asks instead of comparing env_type names).
  virtual std::string amp_refusal() const { return ""; }

  /// The samples this rank's micro-batches of one step add up to: the loop divides each
  /// micro-batch's mean loss by samples_per_step() / samples, so a step is the mean over its
  /// samples whatever its micro-batches. A backend whose step ends up with another count
  /// corrects the gradients in step().
  virtual int64_t samples_per_step() const = 0;

  /// Samples of the next micro-batch, given the micro-batches and samples done in this step;
  /// 0 once the global batch is complete (a fixed count for DDP/ZeRO/TP, the swarm's
  /// progress toward target_batch_size for the decentralized backend).
  virtual int64_t next_micro_batch(int64_t micro_steps_done, int64_t samples_done) const = 0;

  /// Runs one step's micro-batches in the order this parallelism needs: forwards through
  /// `runner`, backwards through backward(). The default is today's loop, each micro-batch's
  /// forward then its backward until next_micro_batch says the step is complete; a pipeline
  /// schedule (1F1B) replaces it.
  virtual void run_micro_batches(MicroBatchRunner& runner);

  /// Backward of one micro-batch's normalised loss; free to start communication from
  /// gradient hooks when `m.sync`.
  virtual void backward(const at::Tensor& loss, const MicroStep& m) = 0;

  /// Reduces gradients where needed, then the shared update (parallel/update.h); gradients are
  /// cleared after. `step` is the count of optimizer steps before this one.
  virtual StepResult step(const StepRequest& request, int64_t step) = 0;

  /// The global value of a logged number (mean over data-parallel ranks).
  virtual double reduce_metric(double local_value) = 0;

  /// After a resume: the global step the checkpoint was saved at (a swarm peer restarts its
  /// epoch count there).
  virtual void set_global_step(int64_t step) {}

  /// Before the first step (after any resume): the global step to start from. A swarm peer
  /// that finds the swarm ahead loads its state from peers and returns the swarm's step; others
  /// return `step`.
  virtual int64_t catch_up(int64_t step) { return step; }

  /// Whether this process trains nothing and only helps the others: a swarm's auxiliary peer
  /// (hivemind.assist_in_averaging). train() then runs assist() instead of its loop.
  virtual bool assists_only() const { return false; }

  /// An auxiliary peer's work from global step `step` until the swarm reaches `until` (or for
  /// ever when `until` is 0): returns the global step reached. The default throws.
  virtual int64_t assist(int64_t step, int64_t until);

  /// Every rank of the job reaches this point before any leaves it (checkpoint protocol).
  virtual void barrier() = 0;

  /// Rank 0's `value` on every rank (collective): e.g. the experiment folder, whose name only
  /// the rank that creates it knows. A backend without a fixed world returns `value`.
  virtual std::string share(const std::string& value) { return value; }

  /// The whole model by name (parameters and buffers), gathered over whatever shards it
  /// (collective). Complete on ranks with writes_model; others may return an empty list.
  virtual NamedTensors full_state(torch::nn::Module& model);

  /// Loads a whole model (as full_state returned it) into this rank's part of the model.
  /// InputError naming `origin` and the tensor on a missing name or wrong shape.
  virtual void load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin);

  /// After training: leaves the whole model in `model` on every rank (collective; a backend
  /// that splits the model gathers it back in place, so the model is a plain one again).
  virtual void release_model(torch::nn::Module& model) {}
  /// Around an evaluation (forwards only, as many as this rank's share of the eval batches):
  /// a backend that partitions parameters holds them whole in between.
  virtual void begin_eval() {}
  virtual void end_eval() {}
  /// Whether the model is split into pipeline stages: then evaluation runs eval_forward, not
  /// forward_step.
  virtual bool pipelined() const { return false; }
  /// Pipeline: the stages' layers and the schedule in one line ("" without a pipeline).
  virtual std::string pipeline_layout() const { return ""; }
  /// Pipeline: one evaluation micro-batch (the model's named inputs) through every stage; its loss
  /// on the last stage, undefined on the others (collective over the pipeline).
  virtual at::Tensor eval_forward(const std::map<std::string, at::Tensor>& inputs);

  /// This rank's own state (optimizer partitions, ...) for its shard of a checkpoint. Every
  /// rank calls save_shard when writes_shard(); a backend whose ranks hold identical state
  /// writes it from one rank only.
  virtual bool writes_shard() const = 0;
  virtual void save_shard(torch::serialize::OutputArchive& archive) = 0;
  /// Loads this rank's state from the checkpoint's shards (any of them: the reader knows the
  /// layout they were saved from). At another layout the backend re-partitions, or throws
  /// InputError saying why it cannot.
  virtual void load_shards(ShardReader& reader) = 0;
};

class Communicator;

/// The one factory: resolves ParallelDims (parallel_dims.h) from the config and the world, then
/// builds the job in order: the model transforms (the TP plan), then one data-parallel strategy
/// over the dp group (replicate, ZeRO-1/2, swarm). InputError for an env_type that is not built
/// yet or unknown, or dims that do not fit together.
std::unique_ptr<Backend> make_backend(const Config& cfg);
/// The same over `world` (tests, or a program that made its own communicator); a swarm
/// (hivemind) has no fixed world and ignores it.
std::unique_ptr<Backend> make_backend(const Config& cfg, std::unique_ptr<Communicator> world);

}  // namespace polytrain
