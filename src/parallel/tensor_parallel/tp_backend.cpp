// TensorParallelBackend: the grid, the plan applied before DDP's prepare (so buckets, the
// broadcast over the data-parallel group and the optimizer see this rank's parts), the norm
// over the tensor-parallel group, and the consolidated model in and out of checkpoints.
#include "polytrain/parallel/tensor_parallel/tp_backend.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/error.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/parallel/tensor_parallel/tp_region.h"
#include "polytrain/trainer/checkpoint.h"
#include "polytrain/trainer/optimizers.h"

namespace polytrain {

using detail::cat;

namespace {

std::unique_ptr<Communicator> checked_world(const Config& cfg, std::unique_ptr<Communicator> world) {
  PT_INPUT_CHECK(cfg.zero_optimization.stage == 0, "env_type deepspeed+mpu: zero_optimization.stage ", cfg.zero_optimization.stage,
                 " over the data-parallel group is not built yet (tensor parallel x data parallel runs with DDP's "
                 "gradient averaging); set zero_optimization.stage to 0");
  if (!world) world = world_communicator(cfg.trainer, parse_device(cfg.trainer.pytorch_device));
  return world;
}

}  // namespace

detail::TpGroups::TpGroups(const Config& cfg, std::unique_ptr<Communicator> world)
    : world_(checked_world(cfg, std::move(world))) {
  ProcessGroups pg = make_process_groups(*world_, cfg.trainer.model_parallel_size);
  tp_ = std::move(pg.tp_group);
  dp_ = std::move(pg.dp_group);
  shape_ = pg.shape;
  coord_ = pg.coord;
}

TensorParallelBackend::TensorParallelBackend(const Config& cfg, std::unique_ptr<Communicator> world)
    : detail::TpGroups(cfg, std::move(world)), DdpBackend(cfg, std::move(dp_)), seed_(cfg.trainer.seed) {
  // DdpBackend set a data-parallel world from its group; the grid's coordinates replace it.
  ctx_.rank = world_->rank();
  ctx_.world_size = world_->size();
  ctx_.tp_rank = coord_.tp_rank;
  ctx_.tp_size = shape_.tp;
  ctx_.dp_rank = coord_.dp_rank;
  ctx_.dp_size = shape_.dp;
  ctx_.writes_logs = ctx_.writes_model = ctx_.commits_checkpoints = ctx_.rank == 0;
}

TensorParallelBackend::~TensorParallelBackend() { set_replayed_generators({}); }

void TensorParallelBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  auto* planned = dynamic_cast<TensorParallelPlanned*>(model.get());
  PT_INPUT_CHECK(planned, "env_type deepspeed+mpu: model '", model->name(),
                 "' has no tensor-parallel plan (supported: BERT / RoBERTa, GPT-2, T5); use env_type pytorchDDP "
                 "or deepspeed");
  // Dropout inside split regions: Megatron's model_parallel_cuda_manual_seed (seed + 2718 + tp_rank).
  // On the CPU a new generator with that seed (the state a clone has after set_current_seed):
  // libtorch 1.13's Generator::clone() never frees its copy (it reclaims a raw pointer whose
  // weak count is 0), which LeakSanitizer reports.
  const uint64_t seed = static_cast<uint64_t>(seed_ + 2718 + ctx_.tp_rank);
  if (ctx_.device.is_cuda()) {
    generator_ = at::globalContext().defaultGenerator(ctx_.device).clone();
    generator_->set_current_seed(seed);
  } else {
    generator_ = at::detail::createCPUGenerator(seed);
  }
  set_replayed_generators({*generator_});
  region_ = make_tp_region(*tp_);
  sharding_ = std::make_unique<TpSharding>(*model, planned->tensor_parallel_plan(), region_, *generator_);
  DdpBackend::prepare(model, cfg);
  // The norm: every TP rank counts its parts of split parameters; replicated ones (identical
  // on every TP rank) count on TP rank 0 only; the sum runs over the TP group.
  norm_params_.emplace();
  for (size_t i = 0; i < params_.size(); ++i)
    if (sharding_->is_sharded(names_[i]) || ctx_.tp_rank == 0) norm_params_->push_back(params_[i]);
  norm_reduce_ = [this](double local) { return sum_over_ranks(*tp_, ctx_.device, local); };
}

void TensorParallelBackend::barrier() { world_->barrier(); }

std::string TensorParallelBackend::share(const std::string& value) {
  return share_from_rank0(*world_, ctx_.device, value);
}

NamedTensors TensorParallelBackend::full_state(torch::nn::Module& model) {
  NamedTensors state = state_with_masters(model);
  for (auto& [name, t] : state)
    if (sharding_ && sharding_->is_sharded(name)) t = sharding_->gather(name, t, *tp_);
  return state;
}

void TensorParallelBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state,
                                            const std::string& origin) {
  NamedTensors mine;
  for (const auto& [name, t] : state)
    mine.emplace_back(name, sharding_ && sharding_->is_sharded(name) ? sharding_->slice(name, t, origin) : t);
  load_module_state(model, mine, origin);
  load_masters(mine);
}

void TensorParallelBackend::save_shard(torch::serialize::OutputArchive& archive) {
  optimizer_->save(archive);
  std::lock_guard<std::mutex> lock(generator_->mutex());
  archive.write("tp_rng_state", generator_->get_state());
}

void TensorParallelBackend::load_shards(ShardReader& reader) {
  const std::string saved_by = reader.env_type();
  PT_INPUT_CHECK(saved_by == name(), reader.origin(), ": optimizer state saved by env_type '", saved_by,
                 "' cannot be loaded by env_type deepspeed+mpu (its optimizer state is per tensor-parallel part); "
                 "export the model (--save_hf) and start from it with --init_from");
  const int64_t saved_tp = reader.saved_grid().value("tp", int64_t{1});
  PT_INPUT_CHECK(saved_tp == ctx_.tp_size, reader.origin(), ": saved at model_parallel_size ", saved_tp,
                 ", this run has ", ctx_.tp_size, "; its optimizer state is split that way: resume with "
                 "--model_parallel_size ", saved_tp, " (any data-parallel size), or start from its model (state.pt is "
                 "the consolidated model; --save_hf exports it) with --init_from at any size");
  // Shard files are named by the global rank that wrote them: (tp_rank, dp_rank 0) = tp_rank.
  PT_INPUT_CHECK(reader.has_shard(ctx_.tp_rank), reader.origin(), ": no optimizer state of tensor-parallel rank ",
                 ctx_.tp_rank, " (", ShardReader::file_name(ctx_.tp_rank), ")");
  reader.read_shard(ctx_.tp_rank, [&](torch::serialize::InputArchive& a, const std::string& origin) {
    optimizer_->load(a, origin);
    at::Tensor rng;
    a.read("tp_rng_state", rng);
    std::lock_guard<std::mutex> lock(generator_->mutex());
    generator_->set_state(rng);
  });
}

void TensorParallelBackend::release_model(torch::nn::Module& model) {
  if (sharding_) sharding_->unshard(model, *tp_);
}

}  // namespace polytrain
