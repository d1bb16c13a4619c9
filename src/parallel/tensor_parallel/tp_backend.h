// env_type "deepspeed+mpu" at zero_optimization.stage 0: Megatron-LM tensor parallelism on a
// TP x DP grid (FlagAI's switch, trainer.model_parallel_size). The TP transform
// (tp_transform.h) splits the model by its plan; each data-parallel group (the ranks holding the
// same part) runs pytorchDDP's bucketed gradient averaging. From stage 1 the factory composes
// the same transform with ZeRO instead (zero_backend.h). TP peers read the same samples. The gradient norm
// counts a split parameter's parts on every TP rank and a replicated one once; checkpoints hold
// the consolidated model (any TP size loads it) plus one optimizer shard per TP rank.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/process_grid.h"

namespace polytrain {

class TensorParallelTransform;

namespace detail {
// The world and its split, built before DdpBackend (which gets the data-parallel group).
struct TpGroups {
  TpGroups(const Config& cfg, std::unique_ptr<Communicator> world);
  std::unique_ptr<Communicator> world_, tp_, dp_;
  GridShape shape_;
  GridCoord coord_;
};
}  // namespace detail

class TensorParallelBackend : private detail::TpGroups, public DdpBackend {
 public:
  /// Uses `world` when given (tests), else the communicator of the launcher's environment.
  explicit TensorParallelBackend(const Config& cfg, std::unique_ptr<Communicator> world = nullptr);
  ~TensorParallelBackend() override;
  std::string name() const override { return "deepspeed+mpu"; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  void barrier() override;
  std::string share(const std::string& value) override;
  NamedTensors full_state(torch::nn::Module& model) override;
  void load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) override;
  bool writes_shard() const override { return ctx_.dp_rank == 0; }
  void save_shard(torch::serialize::OutputArchive& archive) override;
  void load_shards(ShardReader& reader) override;
  void release_model(torch::nn::Module& model) override;

  Communicator& tp_group() { return *tp_; }

 private:
  std::unique_ptr<TensorParallelTransform> tp_transform_;
};

}  // namespace polytrain
