#include "polytrain/models/layer_params.h"

#include <mutex>
#include <unordered_map>

#include <torch/autograd.h>
#include <torch/nn/module.h>

namespace polytrain {

namespace {

std::mutex g_mu;
std::unordered_map<const torch::nn::Module*, std::weak_ptr<LayerParams>>& registry() {
  static std::unordered_map<const torch::nn::Module*, std::weak_ptr<LayerParams>> r;
  return r;
}

std::shared_ptr<LayerParams> provider_of(const torch::nn::Module& layer) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& r = registry();
  if (r.empty()) return nullptr;
  const auto it = r.find(&layer);
  return it == r.end() ? nullptr : it->second.lock();
}

// Identity forward; its backward fetches the layer's parameters before the gradient flows on
// into the layer's own nodes (which read them).
struct FetchBeforeBackward : torch::autograd::Function<FetchBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const torch::nn::Module* layer) {
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* layer = reinterpret_cast<const torch::nn::Module*>(ctx->saved_data["layer"].toInt());
    if (auto p = provider_of(*layer)) p->fetch(*layer, /*for_backward=*/true);
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

void set_layer_params(const torch::nn::Module& layer, const std::shared_ptr<LayerParams>& provider) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (provider) registry()[&layer] = provider;
  else registry().erase(&layer);
}

bool has_layer_params(const torch::nn::Module& layer) { return provider_of(layer) != nullptr; }

at::Tensor in_layer(const torch::nn::Module& layer, const std::function<at::Tensor()>& fn) {
  const auto p = provider_of(layer);
  if (!p) return fn();
  p->fetch(layer, /*for_backward=*/false);
  at::Tensor out;
  try {
    out = fn();
  } catch (...) {
    p->done(layer);
    throw;
  }
  p->done(layer);
  if (torch::autograd::GradMode::is_enabled() && out.requires_grad()) out = FetchBeforeBackward::apply(out, &layer);
  return out;
}

}  // namespace polytrain
