// Adam / AdamW over all the parameters of a group at once, on the state of a libtorch
// torch::optim::Adam / AdamW (so checkpoints, statistics and the per-parameter path stay
// interchangeable): `foreach`, a handful of multi-tensor kernels per group (LibTorch's
// _foreach_* ops, any version and device; the per-parameter loop's exact arithmetic), or
// `fused`, LibTorch's single _fused_adam(w)_ kernel (LibTorch >= 2.0; CUDA, and the CPU from
// 2.4). torch.optim's `foreach=True` / `fused=True`: on a GPU the per-parameter loop costs
// about ten kernel launches per tensor.
#pragma once

#include <unordered_map>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class Optimizer;
}

namespace polytrain {

enum class MultiTensorMode { kOff, kForeach, kFused };

/// Whether this LibTorch has the fused Adam/AdamW kernels (>= 2.0).
bool fused_adam_available();

/// The fused kernels read each parameter's step count from a float tensor on its device
/// (advanced before each call, as torch.optim does); the host's int step in the libtorch
/// state is kept in step with it.
struct FusedAdamSteps {
  std::unordered_map<const void*, at::Tensor> by_param;  ///< TensorImpl* -> step tensor
};

/// One step of every group of `opt` (a torch::optim::Adam when !decoupled, AdamW when
/// decoupled), amsgrad off, in `mode` (kForeach or kFused). Parameters without a gradient
/// are left alone; state is created as libtorch creates it.
void multi_tensor_adam_step(torch::optim::Optimizer& opt, MultiTensorMode mode, bool decoupled, FusedAdamSteps& steps);

}  // namespace polytrain
