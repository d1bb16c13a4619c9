// Language-model loss without materialising the [N, V] logits: hidden states are projected
// onto the vocabulary chunk by chunk of rows, each chunk's cross-entropy and its gradients
// (dh, dW, db) are formed while the chunk is hot in cache, and backward only rescales them.
// Same loss and gradients as linear + cross_entropy(ignore_index) with mean reduction, to
// float rounding, and the same matmul work: every row is projected; rows labelled
// ignore_index get weight 0 (skipping them is model.sparse_prediction's job, not this one's).
// On a tiny BERT this removes ~80% of a CPU training step: log_softmax, its backward and the
// zero-fill of the logits gradient are memory-bound passes over 500 MB at batch 32 x 128.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include <ATen/core/Tensor.h>

namespace polytrain {

struct TpSlot;

/// hidden [..., H], weight [V, H], bias [V] or undefined, labels [...] (int64, ignore_index
/// where no prediction is wanted). Returns the mean loss over labelled rows (NaN when there
/// are none, as torch's cross_entropy). Differentiable w.r.t. hidden, weight and bias.
/// chunk_rows <= 0 picks ~32 MB of logits per chunk (256 rows at V = 30522: measured best of
/// 2, 8, 32, 64, 128 MB on bench_bert_step tiny; smaller chunks re-read dW more often); on a
/// GPU ~1 GiB. matmul: the dtype of the matmul operands; unset: the autocast dtype on a GPU
/// under autocast (bf16/fp16 logits, fp32 log-softmax and accumulators), else fp32. On a GPU
/// the labelled count stays on the device: no host sync. pad_vocab_to: the vocabulary is
/// padded to a multiple of it inside (zero weight rows, -inf logits: the same loss and
/// gradients), so that the GEMMs' rows stay aligned; 0 picks 64 on a GPU and none on a CPU. On
/// a GPU with polytrain's CUDA kernels (ops/cuda_ops.h) the cross-entropy chain of each chunk
/// is one kernel.
at::Tensor fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& bias, const at::Tensor& labels,
                                      int64_t ignore_index = -100, int64_t chunk_rows = 0,
                                      std::optional<at::ScalarType> matmul = std::nullopt,
                                      int64_t pad_vocab_to = 0);

struct LmHeadOutput {
  at::Tensor loss;    ///< undefined without labels
  at::Tensor logits;  ///< undefined on the fused path
};

/// A masked-LM head's loss the three ways the BERT family computes it, in one place: `hidden`
/// [B, T, H] through the head's `transform` (dense, activation, LayerNorm) and decoder
/// (`weight` [V, H], `bias` [V]). sparse: only rows with a label (!= -100) go through the head
/// (NVIDIA/Megatron BERT); fused: fused_linear_cross_entropy, no logits; otherwise full logits
/// (of the selected rows when sparse) and cross_entropy with ignore_index -100. Without labels:
/// the logits of every position. `vocab`: how the decoder is split under tensor parallelism
/// (models/tp_layers.h; null or unsplit: a plain head): the fused path becomes the
/// vocab-parallel cross entropy, logits are gathered.
LmHeadOutput masked_lm_head(const at::Tensor& hidden, const at::Tensor& labels,
                            const std::function<at::Tensor(const at::Tensor&)>& transform, const at::Tensor& weight,
                            const at::Tensor& bias, bool sparse, bool fused, const TpSlot* vocab = nullptr);

}  // namespace polytrain
