#include "parallel/single/single_backend.h"

#include <cmath>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "common/dist_env.h"
#include "common/error.h"
#include "trainer/optimizers.h"

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

double grad_norm(const std::vector<at::Tensor>& params) {
  // Per-tensor sums of squares in float64 (so the norm does not depend on float32 summation
  // order), added on the device; one host sync for the whole model.
  std::vector<at::Tensor> sums;
  sums.reserve(params.size());
  for (const auto& p : params)
    if (p.grad().defined()) sums.push_back(p.grad().to(torch::kDouble).pow(2).sum());
  if (sums.empty()) return 0.0;
  return std::sqrt(torch::stack(sums).sum().item<double>());
}

void clip_grads(const std::vector<at::Tensor>& params, double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return;
  const double coef = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s formula
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(coef);
}

SingleBackend::SingleBackend(const Config& cfg) {
  const int world = read_dist_env().world_size;
  PT_INPUT_CHECK(world == 1, "trainer.env_type: 'pytorch' runs one process, but this is one of ", world,
                 " (WORLD_SIZE); use pytorchDDP to train data-parallel");
  ctx_.device = parse_device(cfg.trainer.pytorch_device);
  accumulation_steps_ = cfg.batch.gradient_accumulation_steps;
  clip_ = cfg.gradient_clipping;
}

SingleBackend::~SingleBackend() = default;

void SingleBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  model_ = std::move(model);
  model_->to(ctx_.device);
  params_.clear();
  auto named = model_->named_parameters(/*recurse=*/true);
  std::vector<std::pair<std::string, torch::Tensor>> named_params;
  for (const auto& item : named) {
    if (!item.value().requires_grad()) continue;
    named_params.emplace_back(item.key(), item.value());
    params_.push_back(item.value());
  }
  optimizer_ = make_optimizer(cfg.optimizer, named_params);
}

bool SingleBackend::ready_to_step(int64_t micro_steps_done) const {
  return micro_steps_done >= accumulation_steps_;
}

void SingleBackend::backward(const at::Tensor& loss) { loss.backward(); }

StepResult apply_update(const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer, double clip,
                        double lr, std::optional<double> beta1, double loss_scale) {
  StepResult result;
  if (loss_scale != 1.0) {  // unscale first: the norm, clipping and the update see true gradients
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(1.0 / loss_scale);
  }
  result.grad_norm = grad_norm(params);
  result.applied = std::isfinite(result.grad_norm);
  if (result.applied) {
    clip_grads(params, result.grad_norm, clip);
    set_learning_rate(optimizer, lr);
    if (beta1) set_beta1(optimizer, *beta1);
    optimizer.step();
  }
  return result;
}

void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive) {
  torch::serialize::OutputArchive opt;
  optimizer.save(opt);
  archive.write("optimizer", opt);
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive opt;
  archive.read("optimizer", opt);
  optimizer.load(opt);
}

StepResult SingleBackend::step(double lr, std::optional<double> beta1, double loss_scale) {
  const StepResult result = apply_update(params_, *optimizer_, clip_, lr, beta1, loss_scale);
  optimizer_->zero_grad();
  return result;
}

void SingleBackend::save_state(torch::serialize::OutputArchive& archive) { save_optimizer_state(*optimizer_, archive); }

void SingleBackend::load_state(torch::serialize::InputArchive& archive) { load_optimizer_state(*optimizer_, archive); }

torch::optim::Optimizer& SingleBackend::optimizer() {
  PT_CHECK(optimizer_, "prepare() was not called");
  return *optimizer_;
}

}  // namespace polytrain
