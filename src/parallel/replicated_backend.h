// What pytorch and pytorchDDP share: every rank holds every parameter and the same optimizer
// state. The batch is a fixed number of equal micro-batches (DeepSpeed's
// gradient_accumulation_steps); the optimizer state is saved once, from rank 0, in the
// universal layout (universal_state.h), and loads from any checkpoint of any grid. Subclasses add communication (or none).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/update.h"

namespace polytrain {

class Optimizer;
class PipelineStage;
class TensorParallelTransform;
struct PieceLayout;

class ReplicatedBackend : public Backend {
 public:
  ~ReplicatedBackend() override;
  const RankContext& context() const override { return ctx_; }
  int64_t samples_per_step() const override { return micro_ * accumulation_; }
  int64_t global_batch() const override { return global_batch_; }
  int64_t next_micro_batch(int64_t micro_steps_done, int64_t samples_done) const override;
  bool writes_shard() const override { return ctx_.rank == 0; }
  void save_shard(torch::serialize::OutputArchive& archive) override;
  void load_shards(ShardReader& reader) override;
  /// With amp master weights: the model with the fp32 masters in place of the half weights.
  NamedTensors full_state(torch::nn::Module& model) override;
  void load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) override;

 protected:
  explicit ReplicatedBackend(const Config& cfg);
  /// Moves the model to the device, applies the `amp` block's cast (O2 / O3) and builds the
  /// optimizer over its trainable parameters (params_ / names_ in registration order), or over
  /// their fp32 master copies when the plan has master weights (O2). `offload`: every
  /// parameter gets a master, an fp32 copy in CPU memory (hivemind's offload_optimizer).
  void build(std::shared_ptr<torch::nn::Module> model, const Config& cfg, bool offload = false);
  /// The shared update over identical gradients (no norm reduction: every rank has all of
  /// them) for the step after `step`. Gradients are left for the caller to clear.
  /// With masters it is the three steps below in a row.
  StepResult update(const StepRequest& request, int64_t step);
  /// Masters: the model's gradients copied into the masters' (a copy, never an alias).
  void grads_to_masters();
  /// Masters: the update on the masters; their gradients are freed after it.
  UpdateOutcome update_masters(const StepRequest& request);
  /// Masters: their values rounded into the model.
  void masters_to_params();
  /// The optimizer's gradients and the model's (they differ under master weights) set to zero.
  void zero_grads();
  /// The model's gradients only (the optimizer's may be in use elsewhere).
  void zero_model_grads();
  /// module_state(model) with each master-weighted parameter replaced by its fp32 master.
  NamedTensors state_with_masters(torch::nn::Module& model) const;
  /// After the model loaded `state`: the masters take its values at full precision.
  void load_masters(const NamedTensors& state);

  /// Where each trainable parameter sits in its logical parameter (its TP part), for the
  /// universal checkpoint layout.
  std::map<std::string, PieceLayout> piece_layout() const;

  RankContext ctx_;
  /// Set by a backend whose model is split by tensor parallelism (not owned).
  TensorParallelTransform* tp_split_ = nullptr;
  /// Set by a backend whose model is cut into pipeline stages (not owned): the optimizer trains
  /// what this stage trains; mirrored parameters are left to their primary stage.
  PipelineStage* pipe_split_ = nullptr;
  int64_t micro_ = 1;
  int64_t accumulation_ = 1;
  int64_t global_batch_ = 1;
  double clip_ = 0.0;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  /// For ranks that hold different parts of the model (tensor parallel): the gradients this
  /// rank counts toward the norm and the sum over the ranks that hold the other parts.
  SquaredNormReducer norm_reduce_;
  std::optional<std::vector<at::Tensor>> norm_params_;
  /// amp master weights (O2): masters_[i] is the fp32 copy of params_[i] the optimizer
  /// updates, or params_[i] itself where that is fp32 already (a normalization layer).
  std::vector<at::Tensor> masters_;
  /// Name -> index of the parameters whose master is a copy (not the parameter itself).
  std::unordered_map<std::string, size_t> master_of_;
  /// The masters of norm_params_ (built at the first update).
  std::optional<std::vector<at::Tensor>> norm_masters_;
};

/// Parses trainer.pytorch_device ("cpu", "cuda", "cuda:N"); InputError when CUDA is asked for
/// and not available.
c10::Device parse_device(const std::string& spec);

}  // namespace polytrain
