// Where a model's layer loop lets a backend own its layers' parameters (ZeRO stage 3, FSDP):
// libtorch modules have no forward pre-hooks, so the loops of the model families call
// in_layer() around each transformer block. Without a provider it is just fn(). With one (a
// backend registers the blocks it partitions), the block's parameters are fetched before its
// forward, let go after it, and fetched again just before its backward reaches it: the block's
// output passes through an identity autograd node whose backward asks for them. The model code
// holds no collective; what fetching means is the provider's business.
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace polytrain {

/// Marks a module class as one layer of a layer loop that calls in_layer() with it (a
/// transformer block): a backend that partitions parameters by layer finds these.
class LayerUnit {
 public:
  virtual ~LayerUnit() = default;
};

/// A backend that owns the parameters of some layers.
class LayerParams {
 public:
  virtual ~LayerParams() = default;
  /// Before the layer's forward (`for_backward` false) or its backward (true): its parameters
  /// must hold their values when this returns.
  virtual void fetch(const torch::nn::Module& layer, bool for_backward) = 0;
  /// After the layer's forward: its parameters may be let go.
  virtual void done(const torch::nn::Module& layer) = 0;
};

/// Registers `provider` for `layer` (replacing any other); a null provider unregisters it.
/// The registry holds the provider weakly: a destroyed backend's layers run plainly.
void set_layer_params(const torch::nn::Module& layer, const std::shared_ptr<LayerParams>& provider);

/// Whether a provider owns `layer`'s parameters (a fused path that skips in_layer must not run).
bool has_layer_params(const torch::nn::Module& layer);

/// fn() as the layer's forward: fetched, run, let go, and fetched again before the backward
/// through fn's output. Nested calls (a checkpointed block recomputed in backward) are fine.
at::Tensor in_layer(const torch::nn::Module& layer, const std::function<at::Tensor()>& fn);

}  // namespace polytrain
