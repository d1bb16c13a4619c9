// Activation checkpointing (FlagAI's checkpoint_activations, DeepSpeed's
// activation_checkpointing, torch.utils.checkpoint in reentrant mode): a block's forward runs
// without keeping its intermediate activations; backward runs it again, with the RNG state and
// autocast setting of the first run (so dropout masks and precision match), and back-propagates
// through the recomputed graph. Gradients equal the plain run's, bit for bit on CPU fp32.
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace polytrain {

/// fn(x), keeping only x for backward. Without grad mode, or when nothing needs a gradient, it is
/// just fn(x). Tensors fn reads besides x (masks, ...) are captured by fn and get no gradient.
at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x);

/// fn(inputs) with several inputs, keeping only the inputs for backward: gradients flow into
/// every input that requires one (a T5 decoder block reads the hidden states, the position bias
/// shared by all blocks and the encoder output). Undefined inputs are passed on as undefined.
/// Each input's gradient is the sum of its uses inside fn, handed on as one tensor.
at::Tensor checkpointed(std::function<at::Tensor(const std::vector<at::Tensor>&)> fn,
                        const std::vector<at::Tensor>& inputs);

/// Generators besides the default CPU / CUDA ones whose states checkpointed blocks replay (the
/// tensor-parallel region's dropout stream), for blocks whose forward runs on this thread.
void set_replayed_generators(std::vector<at::Generator> generators);

/// Models with transformer blocks that can be checkpointed implement this; the Trainer switches
/// it on from trainer.checkpoint_activations or an `activation_checkpointing` config block.
class ActivationCheckpointing {
 public:
  virtual ~ActivationCheckpointing() = default;
  virtual void set_activation_checkpointing(bool on) = 0;
};

}  // namespace polytrain
