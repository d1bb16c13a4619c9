// DdpBackend: rank 0's weights broadcast at prepare, bucketed all-reduce (average) started from
// gradient hooks on the boundary micro-step, then the shared update on identical gradients.
#include "polytrain/parallel/ddp/ddp_backend.h"

#include <algorithm>
#include <chrono>
#include <csignal>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/parallel/comm/comm_failure.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/parallel_dims.h"
#include "polytrain/parallel/pipeline/pipeline_stage.h"
#include "polytrain/parallel/tensor_parallel/tp_transform.h"

namespace polytrain {

using detail::cat;

DdpBackend::DdpBackend(const Config& cfg, std::unique_ptr<Communicator> world)
    : ReplicatedBackend(cfg), comm_(std::move(world)), ft_(fault_tolerance_options(cfg)) {
  const auto& t = cfg.trainer;
  // A replacement for a lost rank joins the group the others formed, not the job's first one.
  if (!comm_ && ft_.enabled) {
    if (const int64_t attempt = replacement_attempt(); attempt > 0) join_as_replacement(attempt, t.comm_timeout);
  }
  if (!comm_) comm_ = world_communicator(t, ctx_.device);
  // Every compatibility check, as env_type pytorchDDP unless the grid is deepspeed+mpu's.
  Config as_ddp = cfg;
  if (t.env_type != "deepspeed+mpu") as_ddp.trainer.env_type = "pytorchDDP";
  const ParallelDims dims =
      resolve_parallel_dims(as_ddp, joined_at_ >= 0 ? static_cast<int64_t>(original_members_.size()) : comm_->size());
  PT_INPUT_CHECK(dims.strategy == DpStrategy::kReplicate, "zero_optimization.stage ", dims.zero_stage,
                 " partitions the optimizer: ZeroBackend runs it (make_backend picks it), not DdpBackend");
  set_data_parallel_context(ctx_, *comm_);
  if (dims.tp > 1) name_ = t.env_type;
  // tp > 1: gradients averaged over this rank's DP group, the TP transform over its TP group;
  // pp > 1: the stage's parameters over its DP group, activations over its pipeline.
  PT_INPUT_CHECK(!ft_.enabled || dims.pp == 1, "trainer.fault_tolerance: not with pipeline parallelism "
                 "(trainer.pipeline_parallel_size ", dims.pp, "): a lost rank takes a stage with it");
  TpGrid grid = split_tp_grid(comm_, dims.tp, t.seed, name_, ctx_, dims.pp);
  world_ = std::move(grid.world);
  tp_group_ = std::move(grid.tp_group);
  pp_group_ = std::move(grid.pp_group);
  tp_transform_ = std::move(grid.transform);
  tp_split_ = tp_transform_.get();
  if (pp_group_) {
    pipe_ = std::make_unique<PipelineStage>(*pp_group_, cfg.pipeline, cfg.batch.gradient_accumulation_steps, ctx_.device);
    pipe_split_ = pipe_.get();
  }
  bucket_bytes_ = t.reduce_bucket_size;
  overlap_ = t.overlap_comm;
  find_unused_ = t.find_unused_parameters;
  if (ft_.enabled) enable_fault_tolerance(dims.tp);
}

void DdpBackend::enable_fault_tolerance(int64_t tp) {
  PT_INPUT_CHECK(tp == 1, "trainer.fault_tolerance: not with tensor parallelism (trainer.model_parallel_size ", tp,
                 "): a lost rank takes a part of the model with it");
  // Gloo's TCP pairs write without MSG_NOSIGNAL: a rank writing to a dead peer's socket would die
  // of SIGPIPE (launch: "killed by signal 13"), one lost rank taking a live one with it. Ignored,
  // the write fails with EPIPE, the collective throws, and the group regroups around the loss.
  std::signal(SIGPIPE, SIG_IGN);
  own_accumulation_ = accumulation_;
  if (joined_at_ >= 0) {  // a replacement: the group it joined (join_as_replacement)
    admitted_.assign(original_members_.size(), 0);
    replan();
    return;
  }
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
  admitted_.assign(original_members_.size(), 0);
}

// A replacement: reaches the rendezvous store as a client, asks to join and waits until rank 0
// admits it at a step boundary, then connects the group it is admitted to (or, when a member is
// lost meanwhile, the one the next quorum forms). It has no live state until share_live_state.
void DdpBackend::join_as_replacement(int64_t attempt, double comm_timeout) {
  const DistEnv env = read_dist_env();
  const std::chrono::milliseconds timeout(static_cast<int64_t>(comm_timeout * 1000));
  GlooRendezvous r = gloo_rendezvous_client(env.rank, env.world_size, env.master_addr, env.master_port, timeout);
  new_group_ = std::move(r.new_group);
  store_ = std::move(r.store);
  me_ = env.rank;
  for (int64_t m = 0; m < env.world_size; ++m) original_members_.push_back(m);
  // The others admit it at their next step boundary, once they have regrouped without the lost
  // rank (at most comm_timeout to find a silent one) and finished the step they are in.
  const auto deadline = std::chrono::steady_clock::now() + 2 * timeout + std::chrono::seconds(60);
  Admission a;
  try {
    request_join(store_, me_, attempt);
    a = await_admission(store_, me_, attempt, deadline);
  } catch (const CommFailure& e) {
    throw Error(cat("fault tolerance: rank ", me_, " (a replacement) could not join: ", e.what(),
                    " (the job has ended, or rank 0 was lost)"));
  }
  generation_ = a.generation;
  members_ = a.members;
  joined_at_ = a.step;
  shared_ = a.shared;
  has_state_ = false;
  sync_state_ = true;
  connect();
  while (!comm_) {
    agree(joined_at_);
    connect();
  }
}

// The group of members_ under generation_'s prefix; null when it cannot connect (a member lost).
void DdpBackend::connect() {
  const int rank = static_cast<int>(std::find(members_.begin(), members_.end(), me_) - members_.begin());
  try {
    comm_ = new_group_(cat("ft/g", generation_, "/group"), rank, static_cast<int>(members_.size()));
  } catch (const Error&) {
    comm_.reset();
  }
}

// The micro-batches of members_: each its own while all are in; the missing ones' dealt over them.
void DdpBackend::replan() {
  if (members_.size() == original_members_.size()) {
    plan_.clear();
    accumulation_ = own_accumulation_;
    summed_ = false;
    return;
  }
  plan_ = micro_batch_plan(members_, original_members_.size(), own_accumulation_, me_);
  accumulation_ = static_cast<int64_t>(plan_.size());
  summed_ = true;
}

MembershipChange DdpBackend::admit(int64_t step) {
  // A group just formed (by an admission or a regroup) first settles the live state
  // (share_live_state); every member of it knows, so all skip this check alike.
  if (original_members_.empty() || members_.size() == original_members_.size() || sync_state_) return {};
  const int64_t n = static_cast<int64_t>(original_members_.size());
  at::Tensor pending = torch::full({n}, -1, torch::kLong);
  if (comm_->rank() == 0) {
    const std::vector<int64_t> p = pending_joins(store_, members_, n, admitted_);
    for (int64_t m = 0; m < n; ++m) pending[m] = p[static_cast<size_t>(m)];
  }
  comm_->broadcast(pending, 0);
  std::vector<int64_t> joined, attempts;
  for (int64_t m = 0; m < n; ++m) {
    const int64_t attempt = pending[m].item<int64_t>();
    if (attempt < 0) continue;
    joined.push_back(m);
    attempts.push_back(attempt);
    admitted_[static_cast<size_t>(m)] = attempt;
  }
  if (joined.empty()) return {};
  std::vector<int64_t> members = members_;
  members.insert(members.end(), joined.begin(), joined.end());
  std::sort(members.begin(), members.end());
  ++generation_;
  if (comm_->rank() == 0) {
    const Admission a{generation_, members, step, shared_};
    for (size_t i = 0; i < joined.size(); ++i) write_admission(store_, joined[i], attempts[i], a);
  }
  members_ = members;
  awaiting_ = joined;
  sync_state_ = true;
  for (auto& w : work_) w.reset();
  comm_.reset();
  connect();
  // A member lost while the group with the replacements connects: the others' quorum goes on.
  if (!comm_) throw CommFailure(cat("the group of ranks ", rank_list(members_), " (with replacement rank",
                                    joined.size() > 1 ? "s " : " ", rank_list(joined), ") did not connect"));
  set_data_parallel_context(ctx_, *comm_);
  replan();
  if (buckets_) {
    buckets_->zero();
    buckets_->relearn();  // the replacements' first step learns what to communicate when: so do all
  }
  MembershipChange c;
  c.joined = joined;
  c.members = members_;
  c.generation = generation_;
  return c;
}

bool DdpBackend::share_live_state(const std::function<std::string()>& trainer_part, std::string* received) {
  if (!sync_state_) return false;
  // Whether any member lacks the state: a replacement says so itself, the others know whom they admitted.
  bool lacking = !has_state_;
  for (int64_t m : awaiting_) lacking = lacking || std::find(members_.begin(), members_.end(), m) != members_.end();
  at::Tensor any = torch::full({1}, lacking ? 1 : 0, torch::kLong);
  comm_->all_reduce(any, ReduceOp::kMax);
  if (any.item<int64_t>() == 0) {
    awaiting_.clear();
    sync_state_ = false;
    return false;
  }
  fault_point("join");
  // Rank 0's model (with amp's fp32 masters), optimizer state and the trainer's part, as one archive.
  std::string blob;
  if (comm_->rank() == 0) {
    torch::serialize::OutputArchive a, model, optimizer;
    save_named_tensors(full_state(*model_), model);
    a.write("model", model);
    optimizer_->save(optimizer);
    a.write("optimizer", optimizer);
    const std::string t = trainer_part();
    a.write("trainer", torch::from_blob(const_cast<char*>(t.data()), {static_cast<int64_t>(t.size())}, torch::kUInt8).clone());
    blob = encode_archive(a);
  }
  at::Tensor size = torch::full({1}, static_cast<int64_t>(blob.size()), torch::kLong);
  comm_->broadcast(size, 0);
  at::Tensor bytes = comm_->rank() == 0
                         ? torch::from_blob(blob.data(), {static_cast<int64_t>(blob.size())}, torch::kUInt8).clone()
                         : torch::empty({size.item<int64_t>()}, torch::kUInt8);
  comm_->broadcast(bytes, 0);
  const bool mine = !has_state_;
  if (mine) {
    const std::string origin = cat("the live state from rank ", members_.front());
    torch::serialize::InputArchive a, model, optimizer;
    decode_archive(std::string_view(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), bytes.numel()), origin, a);
    a.read("model", model);
    load_full_state(*model_, load_named_tensors_archive(model), origin);
    a.read("optimizer", optimizer);
    optimizer_->load(optimizer, origin);
    at::Tensor t;
    a.read("trainer", t);
    received->assign(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
    zero_grads();
    has_state_ = true;
  }
  awaiting_.clear();
  sync_state_ = false;
  return mine;
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
  replan();
  sync_state_ = true;  // a replacement the loss interrupted may still lack the live state
  if (buckets_) buckets_->zero();  // the interrupted step's partial gradients
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
  if (pipe_) pipe_->apply(*model);  // then the stage's layers: buckets hold this stage's parameters
  // Every rank starts from rank 0's weights, broadcast before build() so that amp's fp32
  // master weights are copies of rank 0's too.
  model->to(ctx_.device);
  if (joined_at_ < 0) broadcast_module_state(*comm_, *model);  // a replacement gets it later (share_live_state)
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
  if (pipe_) {  // and over the stages, each counting the parameters it trains
    norm_reduce_ = [this](double local) { return pipe_->sum(tp_transform_ ? tp_transform_->sum(local) : local); };
  }
}

void DdpBackend::run_micro_batches(MicroBatchRunner& runner) {
  if (!pipe_) return Backend::run_micro_batches(runner);
  // The schedule's backwards only accumulate; step() all-reduces every bucket.
  pipe_->run(runner, accumulation_, micro_, [this](const at::Tensor& loss, const MicroStep& m) { backward(loss, m); });
}

std::string DdpBackend::pipeline_layout() const { return pipe_ ? pipe_->layout() : ""; }

at::Tensor DdpBackend::eval_forward(const std::map<std::string, at::Tensor>& inputs) {
  PT_CHECK(pipe_ != nullptr, "eval_forward without a pipeline");
  return pipe_->forward_only(inputs);
}

NamedTensors DdpBackend::full_state(torch::nn::Module& model) {
  NamedTensors state = state_with_masters(model);
  if (pipe_) state = pipe_->own(state);
  if (tp_transform_) tp_transform_->gather(state);
  if (pipe_) state = pipe_->gather(std::move(state));
  return state;
}

void DdpBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) {
  NamedTensors mine = tp_transform_ ? tp_transform_->slice(state, origin) : state;
  if (pipe_) mine = pipe_->select(mine);
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
  if (pipe_) pipe_->release(model);  // every stage's parameters on every stage, then whole TP parts
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
    if (!work_[b] && !find_unused_ && !pipe_) {  // a pipeline's backwards never arm the buckets
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
  if (pipe_) pipe_->after_step();
  return r;
}

// Over the whole grid: under TP, comm_ is only this rank's dp group, whose first rank may not be rank 0.
// A replacement takes what the group shared at its start from the admission record.
std::string DdpBackend::share(const std::string& value) {
  if (joined_at_ >= 0 && shared_read_ < shared_.size()) return shared_[shared_read_++];
  std::string v = share_from_rank0(world(), ctx_.device, value);
  if (!original_members_.empty()) shared_.push_back(v);
  return v;
}

double DdpBackend::reduce_metric(double local_value) {
  const double v = mean_over_ranks(*comm_, ctx_.device, local_value);
  return pipe_ ? pipe_->from_last(v) : v;  // a pipeline's losses are its last stage's
}

}  // namespace polytrain
