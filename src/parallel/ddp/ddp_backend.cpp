// DdpBackend: rank 0's weights broadcast at prepare, bucketed all-reduce (average) started from
// gradient hooks on the boundary micro-step, then the shared update on identical gradients.
#include "polytrain/parallel/ddp/ddp_backend.h"

#include <algorithm>
#include <chrono>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/parallel/comm/comm_failure.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/parallel_dims.h"
#include "polytrain/parallel/tensor_parallel/tp_transform.h"

namespace polytrain {

using detail::cat;

DdpBackend::DdpBackend(const Config& cfg, std::unique_ptr<Communicator> world)
    : ReplicatedBackend(cfg), comm_(std::move(world)), ft_(fault_tolerance_options(cfg)) {
  const auto& t = cfg.trainer;
  if (!comm_) comm_ = world_communicator(t, ctx_.device);
  // Every compatibility check, as env_type pytorchDDP unless the grid is deepspeed+mpu's.
  Config as_ddp = cfg;
  if (t.env_type != "deepspeed+mpu") as_ddp.trainer.env_type = "pytorchDDP";
  const ParallelDims dims = resolve_parallel_dims(as_ddp, comm_->size());
  PT_INPUT_CHECK(dims.strategy == DpStrategy::kReplicate, "zero_optimization.stage ", dims.zero_stage,
                 " partitions the optimizer: ZeroBackend runs it (make_backend picks it), not DdpBackend");
  set_data_parallel_context(ctx_, *comm_);
  if (dims.tp > 1) name_ = t.env_type;
  // tp > 1: gradients averaged over this rank's DP group, the TP transform over its TP group.
  TpGrid grid = split_tp_grid(comm_, dims.tp, t.seed, name_, ctx_);
  world_ = std::move(grid.world);
  tp_group_ = std::move(grid.tp_group);
  tp_transform_ = std::move(grid.transform);
  tp_split_ = tp_transform_.get();
  bucket_bytes_ = t.reduce_bucket_size;
  overlap_ = t.overlap_comm;
  find_unused_ = t.find_unused_parameters;
  if (ft_.enabled) enable_fault_tolerance(dims.tp);
}

void DdpBackend::enable_fault_tolerance(int64_t tp) {
  PT_INPUT_CHECK(tp == 1, "trainer.fault_tolerance: not with tensor parallelism (trainer.model_parallel_size ", tp,
                 "): a lost rank takes a part of the model with it");
  new_group_ = gloo_group_factory(*comm_);
  store_ = gloo_store_ops(*comm_);
  // A c10d Gloo group can be rebuilt over the rendezvous store; Open MPI as Debian builds it has
  // no ULFM (a lost rank ends the MPI job) and NCCL is not wired for it.
  PT_INPUT_CHECK(new_group_ && store_.set, "trainer.fault_tolerance: needs trainer.comm_backend gloo, this job runs ",
                 comm_->engine());
  PT_INPUT_CHECK(ft_.min_world_size <= comm_->size(), "trainer.fault_tolerance.min_world_size ", ft_.min_world_size,
                 " is above the world size ", comm_->size());
  for (int64_t r = 0; r < comm_->size(); ++r) original_members_.push_back(r);
  members_ = original_members_;
  me_ = comm_->rank();
  own_accumulation_ = accumulation_;
}

double DdpBackend::loss_divisor() const {
  return summed_ ? static_cast<double>(global_batch_) / static_cast<double>(comm_->size())
                 : static_cast<double>(micro_ * accumulation_);
}

MembershipChange DdpBackend::regroup(int64_t step) {
  PT_CHECK(!original_members_.empty(), "regroup() without trainer.fault_tolerance");
  for (auto& w : work_) w.reset();  // waits for what the broken group still runs (failing fast)
  // Dropping the group closes this rank's connections: a survivor still blocked on one of them
  // fails at once instead of at comm_timeout.
  comm_.reset();
  const std::vector<int64_t> before = members_;
  // A member lost while the new group connects makes the others' connect fail (at comm_timeout):
  // then another quorum, without it.
  while (!comm_) {
    agree(step);
    const int rank = static_cast<int>(std::find(members_.begin(), members_.end(), me_) - members_.begin());
    try {
      fault_point("rendezvous");
      comm_ = new_group_(cat("ft/g", generation_, "/group"), rank, static_cast<int>(members_.size()));
    } catch (const Error&) {
      comm_.reset();
    }
  }
  MembershipChange c;
  c.generation = generation_;
  c.members = members_;
  for (int64_t m : before)
    if (std::find(members_.begin(), members_.end(), m) == members_.end()) c.left.push_back(m);
  set_data_parallel_context(ctx_, *comm_);
  plan_ = micro_batch_plan(members_, original_members_.size(), own_accumulation_, me_);
  accumulation_ = static_cast<int64_t>(plan_.size());
  summed_ = true;
  buckets_->zero();  // the interrupted step's partial gradients
  return c;
}

// One quorum (a new membership generation); InputError below min_world_size, naming the lost ranks.
void DdpBackend::agree(int64_t step) {
  ++generation_;
  try {
    const std::chrono::milliseconds wait(static_cast<int64_t>(ft_.quorum_wait * 1000));
    members_ = agree_membership(store_, generation_, me_, members_, step, wait);
  } catch (const CommFailure& e) {
    throw Error(cat("fault tolerance: no quorum: ", e.what(), "; rank 0's process hosts the rendezvous store, so "
                    "the job cannot survive its loss"));
  }
  if (static_cast<int64_t>(members_.size()) >= ft_.min_world_size) return;
  std::vector<int64_t> lost;
  for (int64_t m : original_members_)
    if (std::find(members_.begin(), members_.end(), m) == members_.end()) lost.push_back(m);
  throw InputError(cat("fault tolerance: rank", lost.size() > 1 ? "s " : " ", rank_list(lost), " of ",
                       original_members_.size(), " lost at step ", step + 1, "; ", members_.size(),
                       " left, below trainer.fault_tolerance.min_world_size ", ft_.min_world_size, ": the job stops"));
}

DdpBackend::~DdpBackend() {
  for (auto& w : work_) w.reset();  // waits for any collective still writing
}

void DdpBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  if (tp_transform_) tp_transform_->apply(*model);  // the model transform first: buckets hold this rank's parts
  // Every rank starts from rank 0's weights, broadcast before build() so that amp's fp32
  // master weights are copies of rank 0's too.
  model->to(ctx_.device);
  broadcast_module_state(*comm_, *model);
  build(std::move(model), cfg);
  buckets_ = std::make_unique<GradBuckets>(params_, names_, bucket_bytes_, [this](size_t b) {
    if (overlap_) launch(b);
  });
  work_.resize(buckets_->size());
  if (tp_transform_) {
    // The norm: every TP rank counts its parts of split parameters; replicated ones (identical
    // on every TP rank) count on TP rank 0 only; the sum runs over the TP group.
    norm_params_.emplace();
    for (size_t i = 0; i < params_.size(); ++i)
      if (tp_transform_->counts_toward_norm(names_[i])) norm_params_->push_back(params_[i]);
    norm_reduce_ = [this](double local) { return tp_transform_->sum(local); };
  }
}

NamedTensors DdpBackend::full_state(torch::nn::Module& model) {
  NamedTensors state = state_with_masters(model);
  if (tp_transform_) tp_transform_->gather(state);
  return state;
}

void DdpBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) {
  const NamedTensors mine = tp_transform_ ? tp_transform_->slice(state, origin) : state;
  load_module_state(model, mine, origin);
  load_masters(mine);
}

void DdpBackend::save_shard(torch::serialize::OutputArchive& archive) {
  ReplicatedBackend::save_shard(archive);  // the universal layout: this TP rank's parts
  if (tp_transform_) tp_transform_->save_rng(archive);
}

void DdpBackend::load_shards(ShardReader& reader) {
  ReplicatedBackend::load_shards(reader);  // any grid's checkpoint, sliced to this TP rank's parts
  if (tp_transform_) tp_transform_->load_rng(reader);  // this TP rank's dropout stream
}

void DdpBackend::release_model(torch::nn::Module& model) {
  if (tp_transform_) tp_transform_->release(model);
}

void DdpBackend::backward(const at::Tensor& loss, const MicroStep& m) {
  if (m.sync) buckets_->arm();  // only the boundary micro-step communicates
  loss.backward();
  if (m.sync && !overlap_) {
    for (size_t b = 0; b < buckets_->size(); ++b) launch(b);
  }
}

void DdpBackend::launch(size_t b) {
  if (!work_[b]) work_[b] = comm_->all_reduce_async(buckets_->bucket(b).buffer, summed_ ? ReduceOp::kSum : ReduceOp::kAvg);
  fault_point("allreduce");
}

StepResult DdpBackend::step(const StepRequest& request, int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t b = 0; b < buckets_->size(); ++b) {
    if (!work_[b] && !find_unused_) {
      const auto missing = buckets_->missing(b);
      if (!missing.empty()) {
        throw InputError(cat("pytorchDDP: parameter '", missing.front(), "' received no gradient in this step on rank ",
                             ctx_.rank, "; set trainer.find_unused_parameters to true if that is intended"));
      }
    }
    launch(b);  // with find_unused_parameters: the unused gradients are zeros, averaged as such
  }
  for (auto& w : work_) {
    w->wait();
    w.reset();
  }
  PT_INPUT_CHECK(buckets_->overfired().empty(), "pytorchDDP: parameter '", buckets_->overfired(),
                 "' received more gradient accumulations in this backward than in the first step, after its "
                 "bucket was all-reduced (the graph changed between steps); set trainer.overlap_comm to false");
  exposed_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Identical gradients on every rank: the same norm, the same skip decision everywhere.
  StepResult r = update(request, step);
  buckets_->zero();
  return r;
}

// Over the whole grid: under TP, comm_ is only this rank's dp group, whose first rank may not be rank 0.
std::string DdpBackend::share(const std::string& value) { return share_from_rank0(world(), ctx_.device, value); }

double DdpBackend::reduce_metric(double local_value) { return mean_over_ranks(*comm_, ctx_.device, local_value); }

}  // namespace polytrain
