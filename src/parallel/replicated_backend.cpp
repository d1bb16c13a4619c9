// ReplicatedBackend: device, optimizer over the whole model, fixed micro-batch count, the
// shared update, optimizer state saved once.
#include "polytrain/parallel/replicated_backend.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/amp.h"
#include "polytrain/parallel/pipeline/pipeline_stage.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/parallel/tensor_parallel/tp_transform.h"
#include "polytrain/parallel/universal_state.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {

c10::Device parse_device(const std::string& spec) {
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(spec);
  } catch (const std::exception&) {
    throw InputError("trainer.pytorch_device: cannot parse '" + spec + "' (expected cpu, cuda or cuda:N)");
  }
  if (device.is_cuda()) {
    PT_INPUT_CHECK(torch::cuda::is_available(), "trainer.pytorch_device: '", spec,
                   "' asked for, but this libtorch has no CUDA or no GPU is visible");
    PT_INPUT_CHECK(!device.has_index() || device.index() < (int)torch::cuda::device_count(),
                   "trainer.pytorch_device: '", spec, "' but only ", torch::cuda::device_count(),
                   " CUDA device(s) are visible");
  } else {
    PT_INPUT_CHECK(device.is_cpu(), "trainer.pytorch_device: unsupported device '", spec, "'");
  }
  return device;
}

ReplicatedBackend::ReplicatedBackend(const Config& cfg) {
  ctx_.device = parse_device(cfg.trainer.pytorch_device);
  micro_ = cfg.batch.train_micro_batch_size_per_gpu;
  accumulation_ = cfg.batch.gradient_accumulation_steps;
  global_batch_ = cfg.batch.train_batch_size;
  clip_ = cfg.gradient_clipping;
}

ReplicatedBackend::~ReplicatedBackend() = default;

int64_t ReplicatedBackend::next_micro_batch(int64_t micro_steps_done, int64_t /*samples_done*/) const {
  return micro_steps_done < accumulation_ ? micro_ : 0;
}

void ReplicatedBackend::build(std::shared_ptr<torch::nn::Module> model, const Config& cfg, bool offload) {
  model_ = std::move(model);
  model_->to(ctx_.device);
  const AmpPlan amp = amp_plan(cfg.amp);
  NamedParams named;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (pipe_split_ && pipe_split_->mirrors(item.key())) continue;
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
  if (amp.master_weights || offload) {  // the fp32 weights as they are now, before the cast rounds them
    torch::NoGradGuard no_grad;
    for (const auto& p : params_)
      masters_.push_back(offload ? p.detach().to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true)
                                 : p.detach().clone().requires_grad_(true));
  }
  if (amp.cast_model) cast_model_for_amp(*model_, amp_scalar_type(amp.half), amp.keep_norm_fp32);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!offload && !masters_.empty() && params_[i].scalar_type() == masters_[i].scalar_type()) masters_[i] = params_[i];
    if (!masters_.empty() && !masters_[i].is_same(params_[i])) master_of_[names_[i]] = i;
    named.emplace_back(names_[i], masters_.empty() ? params_[i] : masters_[i]);
  }
  // A pipeline stage may train nothing of its own (ALBERT's middle stages hold only the shared
  // layer, trained on the first stage): it steps no optimizer but still takes part in the norm.
  if (named.empty() && pipe_split_) return;
  optimizer_ = make_optimizer(cfg.optimizer, split_by_decay(cfg.optimizer, named));
}

StepResult ReplicatedBackend::update(const StepRequest& request, int64_t step) {
  if (!optimizer_) {  // nothing to train here: the global norm's decision all the same
    UpdateOutcome u;
    u.grad_norm = std::sqrt(norm_reduce_ ? norm_reduce_(0.0) : 0.0);
    u.applied = std::isfinite(u.grad_norm);
    return step_result(u, step, global_batch_);
  }
  if (masters_.empty())
    return step_result(apply_update(params_, *optimizer_, update_options(request, clip_), norm_reduce_,
                                    norm_params_ ? &*norm_params_ : nullptr),
                       step, global_batch_);
  // Master weights: the half gradients (already reduced) into fp32, the update on the masters,
  // the result rounded back into the model.
  grads_to_masters();
  const UpdateOutcome u = update_masters(request);
  if (u.applied) masters_to_params();
  return step_result(u, step, global_batch_);
}

void ReplicatedBackend::grads_to_masters() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& m = masters_[i];
    if (m.is_same(params_[i])) continue;
    const at::Tensor& g = params_[i].grad();
    m.mutable_grad() = g.defined() ? g.to(m.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true) : at::Tensor();
  }
}

UpdateOutcome ReplicatedBackend::update_masters(const StepRequest& request) {
  torch::NoGradGuard no_grad;
  if (norm_params_ && !norm_masters_) {  // once: the masters of the parameters counted in the norm
    norm_masters_.emplace();
    size_t i = 0;  // norm_params_ is a subsequence of params_
    for (const auto& p : *norm_params_) {
      while (i < params_.size() && !params_[i].is_same(p)) ++i;
      PT_CHECK(i < params_.size(), "amp: a norm parameter is not a trainable parameter");
      norm_masters_->push_back(masters_[i]);
    }
  }
  const UpdateOutcome u = apply_update(masters_, *optimizer_, update_options(request, clip_), norm_reduce_,
                                       norm_masters_ ? &*norm_masters_ : nullptr);
  // The fp32 gradient lives only through the update: backward, where activations peak, holds
  // half gradients, half weights, fp32 masters and Adam state (16 bytes a parameter).
  for (size_t i = 0; i < params_.size(); ++i)
    if (!masters_[i].is_same(params_[i])) masters_[i].mutable_grad() = at::Tensor();
  return u;
}

void ReplicatedBackend::masters_to_params() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!masters_[i].is_same(params_[i])) params_[i].detach().copy_(masters_[i]);
}

void ReplicatedBackend::zero_grads() {
  if (optimizer_) optimizer_->zero_grad();
  if (!masters_.empty()) zero_model_grads();
}

void ReplicatedBackend::zero_model_grads() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

NamedTensors ReplicatedBackend::state_with_masters(torch::nn::Module& model) const {
  NamedTensors state = module_state(model);
  for (auto& [name, t] : state)
    if (auto it = master_of_.find(name); it != master_of_.end()) t = masters_[it->second].detach();
  return state;
}

void ReplicatedBackend::load_masters(const NamedTensors& state) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : state)
    if (auto it = master_of_.find(name); it != master_of_.end()) masters_[it->second].copy_(t);
}

NamedTensors ReplicatedBackend::full_state(torch::nn::Module& model) { return state_with_masters(model); }

void ReplicatedBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state,
                                        const std::string& origin) {
  Backend::load_full_state(model, state, origin);
  load_masters(state);
}

std::map<std::string, PieceLayout> ReplicatedBackend::piece_layout() const {
  std::map<std::string, PieceLayout> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    PieceLayout l;
    l.local_shape = params_[i].sizes().vec();
    l.whole_shape = tp_split_ ? tp_split_->whole_shape(names_[i], l.local_shape) : l.local_shape;
    if (tp_split_) l.split = tp_split_->split_of(names_[i]);
    out[names_[i]] = l;
  }
  return out;
}

void ReplicatedBackend::save_shard(torch::serialize::OutputArchive& archive) {
  std::vector<StatePiece> pieces = optimizer_ ? optimizer_pieces(*optimizer_, piece_layout()) : std::vector<StatePiece>{};
  // Under tensor parallelism a replicated parameter's state is the same on every TP rank: TP
  // rank 0 saves it, the others only their parts of split parameters.
  if (ctx_.tp_rank != 0)
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const StatePiece& p) { return p.split.parts == 1; }),
                 pieces.end());
  write_state_pieces(archive, pieces);
}

void ReplicatedBackend::load_shards(ShardReader& reader) {
  if (has_universal_state(reader)) {
    // Any grid's checkpoint: each parameter's state whole, then this rank's TP part of it.
    const UniversalState state = read_universal_state(reader);
    std::map<std::string, const TpShardSpec*> specs;
    std::set<std::string> mine(names_.begin(), names_.end());
    for (const auto& n : names_) specs[n] = tp_split_ ? tp_split_->spec(n) : nullptr;
    for (const auto& [name, ps] : state.params)
      PT_INPUT_CHECK(mine.count(name) || (pipe_split_ && (pipe_split_->dropped(name) || pipe_split_->mirrors(name))), reader.origin(),
                     ": optimizer state for parameter '", name, "', which this model does not train");
    if (optimizer_) load_optimizer_state(*optimizer_, state, specs, ctx_.tp_rank, ctx_.tp_size, reader.origin());
    return;
  }
  // The optimizer's own archive (a swarm peer's state): every rank held the same state, rank 0
  // saved it, and it loads at any world size.
  PT_INPUT_CHECK(reader.has_shard(0), "checkpoint has no optimizer state (", ShardReader::file_name(0), ")");
  reader.read_shard(0, [&](torch::serialize::InputArchive& a, const std::string& origin) { optimizer_->load(a, origin); });
}

}  // namespace polytrain
