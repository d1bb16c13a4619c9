// ReplicatedBackend: device, optimizer over the whole model, fixed micro-batch count, the
// shared update, optimizer state saved once.
#include "polytrain/parallel/replicated_backend.h"

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/error.h"
#include "polytrain/trainer/checkpoint.h"
#include "polytrain/trainer/optimizers.h"

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

void ReplicatedBackend::build(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  model_ = std::move(model);
  model_->to(ctx_.device);
  NamedParams named;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    named.emplace_back(item.key(), item.value());
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
  optimizer_ = make_optimizer(cfg.optimizer, split_by_decay(cfg.optimizer, named));
}

StepResult ReplicatedBackend::update(const StepRequest& request, int64_t step) {
  return step_result(apply_update(params_, *optimizer_, update_options(request, clip_), norm_reduce_,
                                  norm_params_ ? &*norm_params_ : nullptr),
                     step, global_batch_);
}

void ReplicatedBackend::save_shard(torch::serialize::OutputArchive& archive) { optimizer_->save(archive); }

void ReplicatedBackend::load_shards(ShardReader& reader) {
  // Every rank held the same state; rank 0 saved it, and it loads at any world size.
  PT_INPUT_CHECK(reader.env_type() != "deepspeed", reader.origin(),
                 ": optimizer state saved by env_type 'deepspeed' (ZeRO, by parameter slice) cannot be loaded by env_type '",
                 name(), "'; resume with env_type deepspeed (any data-parallel size), or export the model with "
                 "zero_to_fp32 and start from it");
  PT_INPUT_CHECK(reader.has_shard(0), "checkpoint has no optimizer state (", ShardReader::file_name(0), ")");
  reader.read_shard(0, [&](torch::serialize::InputArchive& a, const std::string& origin) { optimizer_->load(a, origin); });
}

}  // namespace polytrain
