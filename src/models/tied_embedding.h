// A weight shared by an embedding and an LM head (GPT-2's wte, BERT's and ALBERT's word
// embeddings, T5's shared vocabulary): the head's backward hands the engine a dense [V, H]
// gradient first (it runs before the embedding's, which waits for the whole stack), so the
// embedding's own gradient need not be a second dense [V, H]: its looked-up rows, as a sparse
// gradient, are added into the head's by autograd (InputBuffer: dense + sparse). That drops a
// zero-fill and a dense add of the whole vocabulary per step (GPT-2 124M: two passes over
// 154 MB, ~25 ms of a CPU step). Without the head's dense gradient in the same backward (no
// head, an untied head, a head on another pipeline stage) the embedding's gradient is dense as
// torch::embedding's, so a parameter's .grad is never sparse.
//
// How the two meet: each lookup gets an id; the fused LM loss (models/fused_lm_loss.h), at its
// forward, walks the autograd graph below its hidden states for lookups of its own weight (all
// of them: T5's encoder and decoder both) and, in backward, marks them as given its dense
// gradient; a marked lookup's backward, which the same backward runs next, goes sparse. The one
// gap: a kept graph backed up twice by partial runs (one reaching the head and not the lookup,
// then one reaching the lookup and not the head) would leave a sparse gradient; the trainer and
// the pipeline's schedules never run such a pair.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain::tied_embedding {

/// torch::embedding(weight, ids, padding_idx) (-1: none), whose weight gradient is sparse when
/// the head tied to `weight` has put its dense gradient into the same backward. CPU weights
/// with grad enabled; elsewhere torch::embedding itself.
at::Tensor lookup(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_idx = -1);

/// The ids of the lookups of `weight` that `hidden` was computed from (a walk of its autograd
/// graph; empty at once when `weight` was never looked up with grad), for a head's forward.
std::vector<int64_t> lookups_below(const at::Tensor& hidden, const at::Tensor& weight);

/// A head's backward: it has returned a dense gradient of the weight of these lookups.
void dense_gradient_given(const std::vector<int64_t>& ids);

/// How many lookups' backward in this process gave the sparse gradient (tests, benchmarks).
int64_t sparse_gradients();

}  // namespace polytrain::tied_embedding
