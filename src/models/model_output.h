// What a model's forward (and a Trainer's forward_step) returns: FlagAI's
// {loss, logits, hidden_states} triple. Shared by every model family.
#pragma once

#include <ATen/core/Tensor.h>

namespace polytrain {

struct ModelOutput {
  at::Tensor loss;           ///< scalar, undefined when no labels were given
  at::Tensor logits;         ///< [B, L, V] (or [M, V] when only masked positions were scored)
  at::Tensor hidden_states;  ///< last layer, [B, L, H] (optional)
};

}  // namespace polytrain
