#include "polytrain/models/activation_checkpoint.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "polytrain/common/autocast.h"

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

using MultiFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Generators besides the default ones that checkpointed blocks replay, per training thread; a
// block captures them (and their states) when its forward runs.
thread_local std::vector<at::Generator> replayed_generators;

at::Tensor generator_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
void set_generator_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

struct CheckpointBackward : torch::autograd::Node {
  MultiFn fn;
  std::vector<at::Tensor> inputs;  // detached (undefined stays undefined)
  std::vector<bool> needs_grad;    // per input: did it require a gradient in the forward
  c10::Device device = c10::Device(c10::kCPU);
  at::Tensor cpu_rng, device_rng;  // device_rng: only for CUDA
  std::vector<std::pair<at::Generator, at::Tensor>> extra_rng;  // replayed generators, forward states
  std::optional<c10::ScalarType> autocast;

  std::string name() const override { return "polytrain::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(fn, "checkpointed block: backward ran twice (the recomputation is freed after the first)");
    // Recompute with the forward's RNG states, then put the current ones back.
    const at::Tensor cpu_now = rng_state(c10::Device(c10::kCPU));
    const at::Tensor dev_now = device.is_cuda() ? rng_state(device) : at::Tensor();
    set_rng_state(c10::Device(c10::kCPU), cpu_rng);
    if (device.is_cuda()) set_rng_state(device, device_rng);
    std::vector<at::Tensor> extra_now;
    for (auto& [g, state] : extra_rng) {
      extra_now.push_back(generator_state(g));
      set_generator_state(g, state);
    }
    std::vector<at::Tensor> xs(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined()) xs[i] = inputs[i].detach().requires_grad_(needs_grad[i]);
    at::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      std::unique_ptr<AutocastGuard> cast;
      if (autocast) cast = std::make_unique<AutocastGuard>(device.type(), *autocast);
      y = fn(xs);
    }
    set_rng_state(c10::Device(c10::kCPU), cpu_now);
    if (device.is_cuda()) set_rng_state(device, dev_now);
    for (size_t i = 0; i < extra_rng.size(); ++i) set_generator_state(extra_rng[i].first, extra_now[i]);
    extra_rng.clear();
    // The inputs are leaves here: each one's .grad is the sum of its uses inside the block, in
    // the order the plain graph would add them.
    torch::autograd::backward({y}, {grads[0]});
    fn = nullptr;  // free the closure (and what it captured) now
    inputs.clear();
    variable_list out(xs.size());
    for (size_t i = 0; i < xs.size(); ++i)
      if (xs[i].defined() && needs_grad[i]) out[i] = xs[i].grad();
    return out;
  }
};

}  // namespace

at::Tensor checkpointed(MultiFn fn, const std::vector<at::Tensor>& inputs) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  // The block runs where its first defined input lives.
  for (const auto& t : inputs)
    if (t.defined()) {
      node->device = t.device();
      break;
    }
  node->cpu_rng = rng_state(c10::Device(c10::kCPU));
  if (node->device.is_cuda()) node->device_rng = rng_state(node->device);
  for (auto& g : replayed_generators) node->extra_rng.emplace_back(g, generator_state(g));
  node->autocast = autocast_type(node->device.type());
  at::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(inputs);
  }
  node->fn = std::move(fn);
  for (const auto& t : inputs) {
    node->inputs.push_back(t.defined() ? t.detach() : at::Tensor());
    node->needs_grad.push_back(t.defined() && t.requires_grad());
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(y, node);
  return y;
}

void set_replayed_generators(std::vector<at::Generator> generators) { replayed_generators = std::move(generators); }

at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x) {
  return checkpointed([fn = std::move(fn)](const std::vector<at::Tensor>& xs) { return fn(xs[0]); },
                      std::vector<at::Tensor>{x});
}

}  // namespace polytrain
