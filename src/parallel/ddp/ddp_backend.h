// env_type=pytorchDDP (and deepspeed+mpu at zero_optimization.stage 0): every rank of the dp
// group holds the whole model, or with trainer.model_parallel_size > 1 its tensor-parallel part
// of it (the TP transform, tp_transform.h, applied first: Megatron's DDP over the ranks holding
// the same part); gradients are averaged over the dp group every optimizer step. Gradients live in GradBuckets (flat buffers the .grad tensors are views
// of); when the last gradient of a bucket is in during the boundary micro-step's backward,
// that bucket's async all_reduce starts, so communication overlaps the rest of backward
// (PyTorch DDP's Reducer design). Micro-steps before the boundary communicate nothing.
#pragma once

#include <memory>
#include <vector>

#include "polytrain/common/fault_tolerance_config.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/ddp/fault_tolerance.h"
#include "polytrain/parallel/grad_buckets.h"
#include "polytrain/parallel/replicated_backend.h"

namespace polytrain {

class PipelineStage;
class TensorParallelTransform;

/// With trainer.fault_tolerance (Gloo, tensor-parallel size 1) it is an ElasticGroup
/// (fault_tolerance.h): after a regroup, gradients are summed over the survivors and each
/// micro-batch's loss is divided by the global batch, since the ranks no longer run equal shares.
class DdpBackend : public ReplicatedBackend, public ElasticGroup {
 public:
  /// Uses `world` when given (tests), else the communicator of the launcher's environment. With
  /// trainer.model_parallel_size > 1 the world is split into the TP x DP grid.
  explicit DdpBackend(const Config& cfg, std::unique_ptr<Communicator> world = nullptr);
  ~DdpBackend() override;
  std::string name() const override { return name_; }
  std::string comm_engine() const override { return comm_->engine(); }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  void run_micro_batches(MicroBatchRunner& runner) override;
  bool pipelined() const override { return pipe_ != nullptr; }
  std::string pipeline_layout() const override;
  at::Tensor eval_forward(const std::map<std::string, at::Tensor>& inputs) override;
  /// The pipeline stage of this rank (null at pipeline_parallel_size 1).
  PipelineStage* pipeline() { return pipe_.get(); }
  void backward(const at::Tensor& loss, const MicroStep& m) override;
  StepResult step(const StepRequest& request, int64_t step) override;
  double reduce_metric(double local_value) override;
  void barrier() override { world().barrier(); }
  std::string share(const std::string& value) override;
  NamedTensors full_state(torch::nn::Module& model) override;
  void load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) override;
  bool writes_shard() const override { return ctx_.dp_rank == 0; }
  void save_shard(torch::serialize::OutputArchive& archive) override;
  void load_shards(ShardReader& reader) override;
  void release_model(torch::nn::Module& model) override;
  int64_t samples_per_step() const override { return summed_ ? global_batch_ : micro_ * accumulation_; }

  MembershipChange regroup(int64_t step) override;
  const std::vector<MicroBatchSlot>& plan() const override { return plan_; }
  int64_t original_members() const override { return original_members_.size(); }
  double loss_divisor() const override;
  int64_t joined_at() const override { return joined_at_; }
  MembershipChange admit(int64_t step) override;
  bool share_live_state(const std::function<std::string()>& trainer_part, std::string* received) override;
  int64_t original_rank() const override { return me_; }

  /// The tensor-parallel group (this rank alone when tp is 1).
  Communicator& tp_group() { return tp_group_ ? *tp_group_ : *comm_; }

  size_t bucket_count() const { return buckets_ ? buckets_->size() : 0; }
  /// Seconds step() spent waiting for all-reduces not yet finished (exposed communication).
  double exposed_comm_seconds() const { return exposed_comm_seconds_; }

 private:
  void launch(size_t bucket);
  void enable_fault_tolerance(int64_t tp);
  void agree(int64_t step);
  void join_as_replacement(int64_t attempt, double comm_timeout);
  void connect();
  void replan();
  Communicator& world() { return world_ ? *world_ : *comm_; }

  std::string name_ = "pytorchDDP";
  std::unique_ptr<Communicator> world_;      ///< the whole grid (null at TP 1: comm_ is the world)
  std::unique_ptr<Communicator> tp_group_;
  std::unique_ptr<Communicator> pp_group_;   ///< this rank's pipeline (null at PP 1)
  std::unique_ptr<PipelineStage> pipe_;      ///< PP > 1: the stage's layers, applied after TP
  std::unique_ptr<TensorParallelTransform> tp_transform_;  ///< TP > 1: the model transform applied first
  std::unique_ptr<Communicator> comm_;       ///< the data-parallel group gradients are averaged over
  int64_t bucket_bytes_ = 25000000;
  bool overlap_ = true;
  bool find_unused_ = false;
  double exposed_comm_seconds_ = 0.0;
  std::unique_ptr<GradBuckets> buckets_;
  std::vector<std::unique_ptr<CommWork>> work_;  ///< per bucket, while its all_reduce runs
  // Fault tolerance:
  FaultToleranceOptions ft_;
  GlooGroupFactory new_group_;
  StoreOps store_;
  std::vector<int64_t> original_members_;  ///< 0 .. world size - 1 at the start
  std::vector<int64_t> members_;           ///< the original ranks of the current group, in rank order
  int64_t me_ = 0;                         ///< this rank's original rank
  int64_t own_accumulation_ = 1;           ///< micro-batches of each member's share
  int64_t generation_ = 0;
  bool summed_ = false;                    ///< after a regroup: sum, not mean, over the group
  std::vector<MicroBatchSlot> plan_;
  // Replacing lost ranks:
  int64_t joined_at_ = -1;                 ///< a replacement: the step it was admitted at
  bool has_state_ = true;                  ///< false in a replacement until the live state is in
  std::vector<int64_t> admitted_;          ///< per original rank: the last replacement attempt admitted
  std::vector<int64_t> awaiting_;          ///< admitted members the live state has not reached yet
  bool sync_state_ = false;                ///< after an admission or a regroup: share_live_state checks
  std::vector<std::string> shared_;        ///< share()'s results, for replacements
  size_t shared_read_ = 0;                 ///< a replacement: how many of them share() has returned
};

}  // namespace polytrain
