// env_type=deepspeed: ZeRO (Rajbhandari et al., SC 2020) stages 0, 1 and 2 over the data-
// parallel ranks, with the optimizer optionally offloaded to CPU memory (ZeRO-Offload, Ren et
// al., USENIX ATC 2021), configured by DeepSpeed's `zero_optimization` block.
//
// Per parameter group the trainable parameters become views of one flat buffer (ZeroLayout:
// padded to ranks x 16 elements, rank r owns partition r). Each rank keeps fp32 master weights
// (the partition of the flat buffer itself when the parameters are fp32 and not offloaded),
// Adam moments and the reduced gradient for its partition only, and updates just that.
//   stage 0: every rank owns everything: gradients all-reduced, no gather (DeepSpeed's stage 0).
//   stage 1: .grad are views of a full flat gradient buffer (accumulated over micro-steps); at
//            the accumulation boundary each gradient bucket's slice of partition r is reduced
//            to rank r.
//   stage 2: the same reductions, but bucket by bucket during every micro-step's backward: a
//            bucket's gradients are copied into a reduce buffer and freed, its slices reduced to
//            their owners, who add them to their gradient partition; only that partition (plus
//            one or two reduce buffers) is kept. Stage 1 and 2 issue the same reductions, so at
//            one micro-step per step they produce bit-identical results.
// After the update each owner's partition is broadcast in place (allgather_bucket_size
// elements at a time): Gloo has no flat all-gather (see gloo_communicator.cpp). Bytes per step
// are 2 x the parameters, as DDP's all-reduce. The global gradient norm and the overflow flag
// come from one all-reduce of the partitions' squared norms (parallel/update.h), so every rank
// clips and skips alike. Only Adam/AdamW (DeepSpeed's ZeRO + offload optimizers) are sharded;
// other optimizers are refused with the reason.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/zero/zero_layout.h"

namespace polytrain {

class LayerParams;
class Optimizer;
class PipelineStage;
class TensorParallelTransform;
struct OptimizerConfig;
struct ParamGroup;
struct ParallelDims;

/// Bytes this rank holds for the training state, by the backend's own accounting.
struct ZeroMemory {
  int64_t params = 0;           ///< the flat parameter buffers (the whole model, every rank)
  int64_t master = 0;           ///< fp32 master weights kept apart from the parameters (offload, half)
  int64_t optimizer_state = 0;  ///< Adam moments of the owned partitions
  int64_t gradients = 0;        ///< gradient buffers kept across steps (full: stage 0/1; partition: stage 2)
  int64_t reduce_buffers = 0;   ///< stage 2's bucket buffers
  int64_t host_copies = 0;      ///< offload: the CPU gradient copy (+ half-precision copy-out buffer)
  /// Stage 3: `params` counts the owned partitions and the persistent parameters; these are the
  /// gathered layers' buffers now and at most since the start.
  int64_t gathered_params = 0, gathered_params_peak = 0;
};

class ZeroBackend : public Backend {
 public:
  /// Uses `world` when given (tests), else the communicator of the launcher's environment.
  /// With trainer.model_parallel_size > 1 (env_type deepspeed+mpu) the world is split into a
  /// TP x DP grid: the TP transform splits the model, ZeRO partitions over the dp group.
  explicit ZeroBackend(const Config& cfg, std::unique_ptr<Communicator> world = nullptr);
  ~ZeroBackend() override;
  std::string name() const override { return name_; }
  std::string comm_engine() const override { return comm_->engine(); }
  const RankContext& context() const override { return ctx_; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  int64_t samples_per_step() const override { return micro_ * accumulation_; }
  int64_t global_batch() const override { return global_batch_; }
  std::string amp_refusal() const override {
    if (name_ == "deepspeed")
      return "amp with env_type deepspeed: ZeRO keeps its own fp32 master weights; amp runs with env_type pytorch, "
             "pytorchDDP or deepspeed+mpu (at zero_optimization.stage 0, pytorchDDP is the same data parallelism), "
             "or use fp16 / bf16 with deepspeed";
    return "amp with env_type " + name_ + " at zero_optimization.stage " + std::to_string(stage_) +
           ": ZeRO keeps its own fp32 master weights; use fp16 / bf16 with ZeRO, or amp at stage 0";
  }
  int64_t next_micro_batch(int64_t micro_steps_done, int64_t samples_done) const override;
  void backward(const at::Tensor& loss, const MicroStep& m) override;
  StepResult step(const StepRequest& request, int64_t step) override;
  double reduce_metric(double local_value) override;
  void barrier() override { world().barrier(); }
  std::string share(const std::string& value) override;
  NamedTensors full_state(torch::nn::Module& model) override;
  void load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) override;
  void release_model(torch::nn::Module& model) override;
  void run_micro_batches(MicroBatchRunner& runner) override;
  bool pipelined() const override { return pipe_ != nullptr; }
  std::string pipeline_layout() const override;
  at::Tensor eval_forward(const std::map<std::string, at::Tensor>& inputs) override;
  /// The pipeline stage of this rank (null at pipeline_parallel_size 1).
  PipelineStage* pipeline() { return pipe_.get(); }
  void begin_eval() override;
  void end_eval() override;
  bool writes_shard() const override { return stage_ > 0 || ctx_.dp_rank == 0; }
  void save_shard(torch::serialize::OutputArchive& archive) override;
  void load_shards(ShardReader& reader) override;

  int stage() const { return stage_; }
  ZeroMemory memory() const;
  const std::vector<ZeroLayout>& layouts() const { return layouts_; }
  /// This rank's optimizer state by parameter slice (tests): master, exp_avg, exp_avg_sq of
  /// each owned piece in flat order, and the step count.
  struct OwnedState {
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;  ///< each piece's parameter (this rank's TP part)
    std::vector<int64_t> begins;   ///< first element of each piece within its parameter
    std::vector<int64_t> lengths;  ///< elements of each piece
    at::Tensor master, exp_avg, exp_avg_sq;  ///< the pieces concatenated (padding left out)
    int64_t step = 0;
  };
  OwnedState owned_state() const;
  size_t bucket_count() const { return buckets_.size(); }
  /// Called by the gradient hooks (stage 2, 3).
  void grad_ready(size_t param);
  /// Stage 3 (tests): the parameter units (the model's layers, the parameters outside them,
  /// the persistent ones) and whether each holds its whole parameters now.
  size_t unit_count() const { return units_.size(); }
  bool unit_gathered(size_t u) const;
  /// Stage 3 (tests): units gathered ahead of their request so far.
  uint64_t prefetched() const { return prefetched_; }
  /// Called by the models' layer loops through in_layer (stage 3).
  void fetch_layer(const torch::nn::Module& layer, bool for_backward);
  void layer_done(const torch::nn::Module& layer);

 private:
  struct Group;
  struct Bucket;
  struct InFlight;
  struct Unit;
  /// Stage 3: the trainable parameters split by unit (then by decay group).
  std::vector<ParamGroup> split_by_unit(const std::vector<ParamGroup>& split);
  /// Each owner's partition of the group's flat buffer broadcast into it (stage 3: the own one
  /// copied in first); the works are appended to `works`.
  void broadcast_partitions(size_t group, std::vector<std::unique_ptr<CommWork>>& works);
  void start_gather(size_t u);  ///< allocates and starts the broadcasts (a prefetch when not waited)
  void fetch_unit(size_t u);    ///< gathered when it returns
  void release_unit(size_t u);
  void note_request(size_t u);  ///< records the trace (first step) or follows it
  bool reused_soon(size_t u) const;
  void prefetch();
  void hold_all();     ///< every unit gathered until let_go_all (eval, export)
  void let_go_all();
  bool partitioned(size_t group) const;  ///< stage 3 and not persistent: the flat buffer comes and goes
  void launch(size_t bucket);
  void launch_remaining();
  void drain(size_t slot);
  void gather_params();
  /// Per group, the runs of 8-bit and fp32 optimizer state in this rank's partition (8-bit
  /// optimizers; empty strings otherwise).
  std::vector<std::string> runs_description() const;
  void check_optimizer(const OptimizerConfig& o) const;
  std::vector<ParamGroup> collect_params(const OptimizerConfig& o);
  void build_partitions(const OptimizerConfig& o, const std::vector<ParamGroup>& split);
  void build_norm_views();
  void build_buckets();
  Communicator& world() { return world_ ? *world_ : *comm_; }
  /// The TP x DP grid of this rank's pipeline stage (the world without pipeline parallelism).
  Communicator& stage_grid() { return stage_grid_ ? *stage_grid_ : world(); }

  std::string name_ = "deepspeed";
  std::unique_ptr<Communicator> world_;  ///< the whole grid (null at TP 1: comm_ is the world)
  std::unique_ptr<Communicator> tp_group_;
  std::unique_ptr<Communicator> pp_group_;    ///< this rank's pipeline (null at PP 1)
  std::unique_ptr<Communicator> stage_grid_;  ///< PP > 1: the ranks of this stage
  std::unique_ptr<PipelineStage> pipe_;       ///< PP > 1: the stage's layers, applied after TP
  std::unique_ptr<TensorParallelTransform> tp_;  ///< TP > 1: the model transform applied first
  std::unique_ptr<Communicator> comm_;  ///< the data-parallel group ZeRO partitions over
  /// TP > 1: views of the owned partition whose gradients count toward the global norm (a
  /// replicated parameter on TP rank 0 only); the squared norm is summed over the whole grid.
  std::vector<at::Tensor> norm_views_;
  RankContext ctx_;
  int stage_ = 0;
  int64_t owners_ = 1;  ///< partitions: the data-parallel size (stage 1, 2) or 1 (stage 0)
  int64_t owner_ = 0;   ///< this rank's partition
  int64_t micro_ = 1, accumulation_ = 1, global_batch_ = 1;
  double clip_ = 0.0;
  bool offload_ = false, pin_memory_ = false, overlap_ = false;
  int64_t reduce_bucket_ = 0, allgather_bucket_ = 0;
  std::shared_ptr<torch::nn::Module> model_;
  std::vector<ZeroLayout> layouts_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<at::Tensor> masters_;  ///< what the optimizer steps (one per group)
  // Trainable parameters in registration order: group, entry, bucket.
  std::vector<at::Tensor> params_;
  std::vector<size_t> group_of_, entry_of_, bucket_of_;
  std::vector<char> ready_;
  std::vector<char> late_;  ///< per bucket: gradients arrived after it was reduced (stage 2)
  size_t next_launch_ = 0;
  bool armed_ = false;
  std::vector<at::Tensor> staging_;                 ///< stage 2 reduce buffers
  std::vector<std::unique_ptr<InFlight>> flight_;   ///< per staging slot (stage 2) / per bucket (0, 1)
  std::shared_ptr<ZeroBackend*> alive_;             ///< what the gradient hooks call through
  std::vector<std::shared_ptr<void>> accumulators_; ///< the hooked AccumulateGrad nodes, kept alive
  // Stage 3.
  bool offload_param_ = false;
  int64_t persistence_threshold_ = 0;
  std::vector<std::unique_ptr<Unit>> units_;          ///< 0: outside the layers; then the layers; persistent last
  size_t root_ = 0;
  std::vector<size_t> unit_of_group_, unit_of_param_;
  std::unordered_map<const torch::nn::Module*, size_t> unit_of_layer_;
  std::shared_ptr<LayerParams> layer_params_;
  int holding_all_ = 0;
  bool released_model_ = false;
  int64_t prefetch_bucket_ = 0, max_live_ = 0, max_reuse_ = 0;
  int64_t live_elements_ = 0;  ///< of the units gathered (or being gathered) now, persistent ones left out
  std::vector<size_t> trace_;  ///< the layers' requests of the first step, in order
  bool tracing_ = false, traced_ = false, in_step_ = false;
  size_t cursor_ = 0;
  uint64_t prefetched_ = 0;
  int64_t gathered_bytes_ = 0, gathered_bytes_peak_ = 0;
};

}  // namespace polytrain
