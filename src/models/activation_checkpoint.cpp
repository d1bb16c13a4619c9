#include "models/activation_checkpoint.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "trainer/autocast.h"

namespace polytrain {

namespace {

using torch::autograd::variable_list;

// The generator state of `device` (CPU, or the CUDA device the block runs on).
at::Tensor rng_state(const c10::Device& device) {
  auto gen = at::globalContext().defaultGenerator(device.is_cuda() ? device : c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_rng_state(const c10::Device& device, const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device.is_cuda() ? device : c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct CheckpointBackward : torch::autograd::Node {
  std::function<at::Tensor(const at::Tensor&)> fn;
  at::Tensor input;  // detached
  c10::Device device = c10::Device(c10::kCPU);
  at::Tensor cpu_rng, device_rng;  // device_rng: only for CUDA
  std::optional<c10::ScalarType> autocast;

  std::string name() const override { return "polytrain::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(fn, "checkpointed block: backward ran twice (the recomputation is freed after the first)");
    // Recompute with the forward's RNG states, then put the current ones back.
    const at::Tensor cpu_now = rng_state(c10::Device(c10::kCPU));
    const at::Tensor dev_now = device.is_cuda() ? rng_state(device) : at::Tensor();
    set_rng_state(c10::Device(c10::kCPU), cpu_rng);
    if (device.is_cuda()) set_rng_state(device, device_rng);
    at::Tensor x = input.detach().requires_grad_(true);
    at::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      std::unique_ptr<AutocastGuard> cast;
      if (autocast) cast = std::make_unique<AutocastGuard>(device.type(), *autocast);
      y = fn(x);
    }
    set_rng_state(c10::Device(c10::kCPU), cpu_now);
    if (device.is_cuda()) set_rng_state(device, dev_now);
    torch::autograd::backward({y}, {grads[0]});
    fn = nullptr;  // free the closure (and what it captured) now
    input = at::Tensor();
    return {x.grad()};
  }
};

}  // namespace

at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->device = x.device();
  node->cpu_rng = rng_state(c10::Device(c10::kCPU));
  if (x.is_cuda()) node->device_rng = rng_state(x.device());
  node->autocast = autocast_type(x.device().type());
  at::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(x);
  }
  node->fn = std::move(fn);
  node->input = x.detach();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(y, node);
  return y;
}

}  // namespace polytrain
