// TensorParallelTransform (see tp_transform.h).
#include "polytrain/parallel/tensor_parallel/tp_transform.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/error.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/parallel/process_grid.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/parallel/tensor_parallel/tp_region.h"

namespace polytrain {

TensorParallelTransform::TensorParallelTransform(Communicator& group, int64_t seed, c10::Device device, std::string env_type)
    : group_(group), rank_(group.rank()), size_(group.size()), seed_(seed), device_(device), env_type_(std::move(env_type)) {}

TensorParallelTransform::~TensorParallelTransform() {
  if (generator_) set_replayed_generators({});
}

void TensorParallelTransform::apply(torch::nn::Module& model) {
  auto* planned = dynamic_cast<TensorParallelPlanned*>(&model);
  PT_INPUT_CHECK(planned, "env_type ", env_type_, ": model '", model.name(),
                 "' has no tensor-parallel plan (supported: BERT / RoBERTa, GPT-2, T5); use env_type pytorchDDP "
                 "or deepspeed");
  // Dropout inside split regions: Megatron's model_parallel_cuda_manual_seed (seed + 2718 + tp_rank).
  // On the CPU a new generator with that seed (the state a clone has after set_current_seed):
  // libtorch 1.13's Generator::clone() never frees its copy (it reclaims a raw pointer whose
  // weak count is 0), which LeakSanitizer reports.
  const uint64_t seed = static_cast<uint64_t>(seed_ + 2718 + rank_);
  if (device_.is_cuda()) {
    generator_ = at::globalContext().defaultGenerator(device_).clone();
    generator_->set_current_seed(seed);
  } else {
    generator_ = at::detail::createCPUGenerator(seed);
  }
  set_replayed_generators({*generator_});
  region_ = make_tp_region(group_);
  sharding_ = std::make_unique<TpSharding>(model, planned->tensor_parallel_plan(), region_, *generator_);
}

bool TensorParallelTransform::is_sharded(const std::string& param) const {
  return sharding_ && sharding_->is_sharded(param);
}

const TpShardSpec* TensorParallelTransform::spec(const std::string& param) const {
  if (!sharding_) return nullptr;
  auto it = sharding_->specs().find(param);
  return it == sharding_->specs().end() ? nullptr : &it->second;
}

double TensorParallelTransform::sum(double local) { return sum_over_ranks(group_, device_, local); }

void TensorParallelTransform::gather(NamedTensors& state) {
  for (auto& [name, t] : state)
    if (is_sharded(name)) t = sharding_->gather(name, t, group_);
}

NamedTensors TensorParallelTransform::slice(const NamedTensors& whole, const std::string& origin) const {
  NamedTensors mine;
  for (const auto& [name, t] : whole) mine.emplace_back(name, is_sharded(name) ? sharding_->slice(name, t, origin) : t);
  return mine;
}

void TensorParallelTransform::release(torch::nn::Module& model) {
  if (sharding_) sharding_->unshard(model, group_);
}

void TensorParallelTransform::save_rng(torch::serialize::OutputArchive& archive) const {
  PT_CHECK(generator_.has_value(), "tensor parallel: save_rng before apply");
  std::lock_guard<std::mutex> lock(generator_->mutex());
  archive.write("tp_rng_state", generator_->get_state());
}

void TensorParallelTransform::load_rng(torch::serialize::InputArchive& archive) {
  PT_CHECK(generator_.has_value(), "tensor parallel: load_rng before apply");
  at::Tensor rng;
  if (!archive.try_read("tp_rng_state", rng)) return;  // saved at TP 1: the stream starts from its seed
  std::lock_guard<std::mutex> lock(generator_->mutex());
  generator_->set_state(rng);
}

std::vector<int64_t> TensorParallelTransform::whole_shape(const std::string& param, std::vector<int64_t> local_shape) const {
  if (const TpShardSpec* s = spec(param)) local_shape[s->dim] = s->whole;
  return local_shape;
}

StateSplit TensorParallelTransform::split_of(const std::string& param) const {
  const TpShardSpec* s = spec(param);
  return s ? state_split(*s, rank_, size_) : StateSplit{};
}

void TensorParallelTransform::load_rng(const ShardReader& reader) {
  if (reader.saved_grid().value("tp", int64_t{1}) != size_ || !reader.has_shard(rank_)) return;
  reader.read_shard(rank_, [&](torch::serialize::InputArchive& a, const std::string&) { load_rng(a); });
}

TpGrid split_tp_grid(std::unique_ptr<Communicator>& comm, int64_t tp, int64_t seed, const std::string& env_type,
                     RankContext& ctx, int64_t pp) {
  TpGrid g;
  if (tp <= 1 && pp <= 1) return g;
  g.world = std::move(comm);
  ProcessGroups pg = make_process_groups(*g.world, tp, pp);
  g.tp_group = std::move(pg.tp_group);
  g.pp_group = std::move(pg.pp_group);
  comm = std::move(pg.dp_group);
  ctx.tp_rank = pg.coord.tp_rank;
  ctx.tp_size = pg.shape.tp;
  ctx.dp_rank = pg.coord.dp_rank;
  ctx.dp_size = pg.shape.dp;
  ctx.pp_rank = pg.coord.pp_rank;
  ctx.pp_size = pg.shape.pp;
  if (tp > 1) g.transform = std::make_unique<TensorParallelTransform>(*g.tp_group, seed, ctx.device, env_type);
  return g;
}

}  // namespace polytrain
