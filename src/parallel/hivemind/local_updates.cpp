// HivemindBackend's local updates (hivemind.outer_optimizer, DiLoCo: arXiv 2311.08105; OpenDiLoCo:
// arXiv 2407.07852): the inner steps between two rounds, the outer step after the
// pseudo-gradient round, and what a donor serves and a checkpoint keeps of the outer state. The
// rounds themselves are the gradient rounds of hivemind_backend.cpp over another vector.
#include <cmath>
#include <cstdio>
#include <map>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/lr_schedule.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/parallel/hivemind/hivemind_backend.h"
#include "polytrain/parallel/hivemind/outer_optimizer.h"

namespace polytrain {

namespace hm = hivemind;

void HivemindBackend::configure_local_updates(const Config& cfg) {
  const nlohmann::json& given = cfg.source;
  const nlohmann::json section =
      given.is_object() && given.contains("hivemind") ? given["hivemind"] : nlohmann::json::object();
  const auto o = hm::parse_outer_optimizer(section);
  if (!o) return;
  PT_INPUT_CHECK(!h_.delay_optimizer_step, "hivemind.outer_optimizer: cannot be combined with "
                 "hivemind.delay_optimizer_step (local updates step the optimizer on every micro-batch: there is no "
                 "update to delay)");
  PT_INPUT_CHECK(h_.average_opt_statistics.empty(), "hivemind.outer_optimizer: cannot be combined with "
                 "hivemind.average_opt_statistics (with local updates each peer's inner optimizer state stays its "
                 "own and no state round runs)");
  // The inner steps run inside backward(), where the loss scale of the step is not known.
  PT_INPUT_CHECK(!cfg.fp16.enabled, "hivemind.outer_optimizer: fp16 (dynamic loss scaling) is not supported with "
                 "local updates; use bf16 or fp32");
  outer_json_ = section["outer_optimizer"];
  outer_ = std::make_unique<hm::OuterOptimizer>(*o);
  inner_schedule_ = make_lr_schedule(cfg.scheduler, cfg.optimizer.lr);
}

void HivemindBackend::prepare_local_updates(const Config& cfg) {
  if (!outer_) return;
  // Never stepped: its archive is the same on every peer, so donors of one epoch agree on the
  // digest of the state they serve (each peer's own inner state differs).
  NamedParams named;
  for (size_t i = 0; i < params_.size(); ++i) named.emplace_back(names_[i], held()[i]);
  fresh_inner_ = make_optimizer(cfg.optimizer, split_by_decay(cfg.optimizer, named));
  outer_->reset(held());
  const auto& o = outer_->options();
  std::printf("hivemind: local updates (DiLoCo): every micro-batch is a step of this peer's %s on its own data; each "
              "global step averages the pseudo-gradients (compression %s) and applies the outer %s (lr %g, momentum "
              "%g)\n", cfg.optimizer.type.c_str(), h_.compression.c_str(),
              o.nesterov ? "Nesterov SGD" : "SGD", o.lr, o.momentum);
  std::fflush(stdout);
}

void HivemindBackend::inner_step(int64_t samples) {
  torch::NoGradGuard no_grad;
  // The loop normalised the loss by one micro-batch: the step takes this micro-batch's mean.
  if (samples != micro_)
    for (auto& p : params_)
      if (p.grad().defined()) p.grad().mul_(static_cast<double>(micro_) / static_cast<double>(samples));
  // The trainer's schedule at the global step, the lr its update would have had (the same on
  // every peer of the epoch).
  const StepRequest inner{inner_schedule_->lr(epoch_), inner_schedule_->momentum(epoch_), 1.0};
  update(inner, epoch_);  // a non-finite gradient skips this inner step only
  zero_grads();
}

StepResult HivemindBackend::outer_update(int64_t step, int64_t epoch, int64_t local) {
  torch::NoGradGuard no_grad;
  // From the outer step to the next epoch the served state changes: a donor's snapshot waits.
  std::lock_guard<std::mutex> lock(state_mu_);
  const at::Tensor delta = flat_.narrow(0, 0, outer_->numel());
  UpdateOutcome u;
  u.grad_norm = delta.norm().item<double>();
  u.applied = std::isfinite(u.grad_norm);
  // A non-finite average leaves the outer parameters as they were (the local steps are dropped).
  if (u.applied) outer_->step(delta);
  outer_->copy_to(held());
  if (!masters_.empty()) masters_to_params();
  zero_grads();
  epoch_ = epoch + 1;
  std::printf("hivemind: outer step %lld: %lld inner steps on %lld local samples, pseudo-gradient norm %.6g%s\n",
              static_cast<long long>(epoch_), static_cast<long long>(mini_steps_), static_cast<long long>(local),
              u.grad_norm, u.applied ? "" : " (not finite: the outer parameters stay as they were)");
  std::fflush(stdout);
  return step_result(u, step, global_batch_);
}

NamedTensors HivemindBackend::outer_state() const {
  std::map<std::string, at::Tensor> outer;
  const auto views = outer_->views(held());
  for (size_t i = 0; i < names_.size(); ++i) outer[names_[i]] = views[i];
  NamedTensors state = module_state(*model_);
  for (auto& [name, t] : state)
    if (const auto it = outer.find(name); it != outer.end()) t = it->second;
  return state;
}

std::string HivemindBackend::outer_optimizer_bytes() const {
  torch::serialize::OutputArchive o;
  fresh_inner_->save(o);
  o.write(hm::kOuterMomentumKey, outer_->momentum());
  return encode_archive(o);
}

void HivemindBackend::load_shards(ShardReader& reader) {
  ReplicatedBackend::load_shards(reader);
  if (!outer_ || !reader.has_shard(0)) return;
  reader.read_shard(0, [&](torch::serialize::InputArchive& a, const std::string& origin) {
    at::Tensor m;
    if (a.try_read(hm::kOuterMomentumKey, m)) {
      outer_->load_momentum(m, origin);
    } else {
      std::fprintf(stderr, "hivemind: %s has no outer momentum (saved without hivemind.outer_optimizer): the outer "
                   "momentum starts at zero\n", origin.c_str());
    }
  });
}

}  // namespace polytrain
