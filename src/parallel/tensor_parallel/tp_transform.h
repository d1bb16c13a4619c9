// Tensor parallelism as a transform of the model, independent of the data-parallel strategy
// that runs after it (composition, as torchtitan's parallelize applies TP before FSDP): the
// model's plan split over the tensor-parallel group, the per-rank dropout stream of split
// regions, which gradients this rank counts toward the global norm, and the consolidated model
// in and out of checkpoints. The strategies (replicate, ZeRO) hold one when tp > 1.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include "polytrain/common/torch_fwd.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/universal_state.h"

namespace polytrain {

class Communicator;
class ShardReader;
class TpSharding;
class TensorParallelRegion;
struct TpShardSpec;

class TensorParallelTransform {
 public:
  /// `group`: the tensor-parallel communicator (not owned; outlives this). `seed`: trainer.seed.
  TensorParallelTransform(Communicator& group, int64_t seed, c10::Device device, std::string env_type);
  ~TensorParallelTransform();
  TensorParallelTransform(const TensorParallelTransform&) = delete;
  TensorParallelTransform& operator=(const TensorParallelTransform&) = delete;

  /// Splits `model` (the whole model, identical on every rank) in place by its plan. InputError
  /// when the model has no plan or a size does not divide.
  void apply(torch::nn::Module& model);

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  bool is_sharded(const std::string& param) const;
  /// How `param` is split (nullptr: replicated on every TP rank).
  const TpShardSpec* spec(const std::string& param) const;
  /// Whether this rank counts `param`'s gradient toward the global norm: its part of a split
  /// parameter on every TP rank, a replicated one on TP rank 0 only.
  bool counts_toward_norm(const std::string& param) const { return is_sharded(param) || rank_ == 0; }
  /// The sum of `local` over the tensor-parallel group (collective).
  double sum(double local);

  /// Split tensors of `state` gathered whole (collective over the TP group).
  void gather(NamedTensors& state);
  /// This rank's parts of a whole model's tensors.
  NamedTensors slice(const NamedTensors& whole, const std::string& origin) const;
  /// The model made whole again in place (collective).
  void release(torch::nn::Module& model);

  /// The whole shape of `param` whose part here has `local_shape`.
  std::vector<int64_t> whole_shape(const std::string& param, std::vector<int64_t> local_shape) const;
  /// Where this rank's part of `param` sits in it (parts 1: replicated, the whole parameter).
  StateSplit split_of(const std::string& param) const;

  /// The dropout stream of the split regions (per TP rank) into / out of a checkpoint shard.
  void save_rng(torch::serialize::OutputArchive& archive) const;
  void load_rng(torch::serialize::InputArchive& archive);
  /// This TP rank's stream from a checkpoint saved at the same TP size (its shard is named by the
  /// global rank (tp_rank, dp_rank 0) = tp_rank); at another size it starts from its seed.
  void load_rng(const ShardReader& reader);

 private:
  Communicator& group_;
  int64_t rank_ = 0, size_ = 1, seed_ = 0;
  c10::Device device_;
  std::string env_type_;
  mutable std::optional<at::Generator> generator_;  ///< Megatron's model_parallel_cuda_manual_seed: seed + 2718 + tp_rank
  std::shared_ptr<TensorParallelRegion> region_;
  std::unique_ptr<TpSharding> sharding_;
};

/// The TP x DP x PP grid a data-parallel strategy runs on: with tp > 1 or pp > 1 the world is
/// split into TP groups (adjacent ranks), DP groups and pipelines, `comm` becomes this rank's DP
/// group, `ctx` gets the grid coordinates and, with tp > 1, the TP transform is built over the TP
/// group; with tp 1 and pp 1 nothing changes and the grid is empty.
struct TpGrid {
  std::unique_ptr<Communicator> world;     ///< null at tp 1 and pp 1 (the strategy's communicator is the world)
  std::unique_ptr<Communicator> tp_group;
  std::unique_ptr<Communicator> pp_group;  ///< null at pp 1
  std::unique_ptr<TensorParallelTransform> transform;  ///< declared last: destroyed before its group
};
TpGrid split_tp_grid(std::unique_ptr<Communicator>& comm, int64_t tp, int64_t seed, const std::string& env_type,
                     RankContext& ctx, int64_t pp = 1);

}  // namespace polytrain
