// TensorParallelBackend: the grid, the TP transform applied before DDP's prepare (so buckets,
// the broadcast over the data-parallel group and the optimizer see this rank's parts), the
// norm over the tensor-parallel group, and the consolidated model in and out of checkpoints.
#include "polytrain/parallel/tensor_parallel/tp_backend.h"

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/tensor_parallel/tp_transform.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {

detail::TpGroups::TpGroups(const Config& cfg, std::unique_ptr<Communicator> world)
    : world_(world ? std::move(world) : world_communicator(cfg.trainer, parse_device(cfg.trainer.pytorch_device))) {
  ProcessGroups pg = make_process_groups(*world_, cfg.trainer.model_parallel_size);
  tp_ = std::move(pg.tp_group);
  dp_ = std::move(pg.dp_group);
  shape_ = pg.shape;
  coord_ = pg.coord;
}

TensorParallelBackend::TensorParallelBackend(const Config& cfg, std::unique_ptr<Communicator> world)
    : detail::TpGroups(cfg, std::move(world)), DdpBackend(cfg, std::move(dp_)) {
  // DdpBackend set a data-parallel world from its group; the grid's coordinates replace it.
  ctx_.rank = world_->rank();
  ctx_.world_size = world_->size();
  ctx_.tp_rank = coord_.tp_rank;
  ctx_.tp_size = shape_.tp;
  ctx_.dp_rank = coord_.dp_rank;
  ctx_.dp_size = shape_.dp;
  ctx_.writes_logs = ctx_.writes_model = ctx_.commits_checkpoints = ctx_.rank == 0;
  PT_INPUT_CHECK(cfg.zero_optimization.stage == 0, "TensorParallelBackend runs deepspeed+mpu at zero_optimization.stage 0; "
                 "stage ", cfg.zero_optimization.stage, " is ZeroBackend over the grid (make_backend picks it)");
  tp_transform_ = std::make_unique<TensorParallelTransform>(*tp_, cfg.trainer.seed, ctx_.device, name());
  tp_split_ = tp_transform_.get();
}

TensorParallelBackend::~TensorParallelBackend() = default;

void TensorParallelBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  tp_transform_->apply(*model);
  DdpBackend::prepare(model, cfg);
  norm_params_.emplace();
  for (size_t i = 0; i < params_.size(); ++i)
    if (tp_transform_->counts_toward_norm(names_[i])) norm_params_->push_back(params_[i]);
  norm_reduce_ = [this](double local) { return tp_transform_->sum(local); };
}

void TensorParallelBackend::barrier() { world_->barrier(); }

std::string TensorParallelBackend::share(const std::string& value) {
  return share_from_rank0(*world_, ctx_.device, value);
}

NamedTensors TensorParallelBackend::full_state(torch::nn::Module& model) {
  NamedTensors state = state_with_masters(model);
  tp_transform_->gather(state);
  return state;
}

void TensorParallelBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state,
                                            const std::string& origin) {
  NamedTensors mine = tp_transform_->slice(state, origin);
  load_module_state(model, mine, origin);
  load_masters(mine);
}

void TensorParallelBackend::save_shard(torch::serialize::OutputArchive& archive) {
  ReplicatedBackend::save_shard(archive);  // the universal layout: this TP rank's parts
  tp_transform_->save_rng(archive);
}

void TensorParallelBackend::load_shards(ShardReader& reader) {
  ReplicatedBackend::load_shards(reader);  // any grid's checkpoint, sliced to this TP rank's parts
  // This TP rank's dropout stream when the checkpoint has the same TP size (its shard is named
  // by the global rank (tp_rank, dp_rank 0) = tp_rank); at another size it starts from its seed.
  const int64_t saved_tp = reader.saved_grid().value("tp", int64_t{1});
  if (saved_tp == ctx_.tp_size && reader.has_shard(ctx_.tp_rank))
    reader.read_shard(ctx_.tp_rank, [&](torch::serialize::InputArchive& a, const std::string&) {
      tp_transform_->load_rng(a);
    });
}

void TensorParallelBackend::release_model(torch::nn::Module& model) { tp_transform_->release(model); }

}  // namespace polytrain
