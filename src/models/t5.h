// T5 encoder-decoder (v1.0: relu, tied embeddings; v1.1 / flan: gated-gelu, own lm_head) in
// libtorch with Hugging Face's parameter names (shared.weight, encoder.block.0.layer.0.SelfAttention.q.weight,
// ...), so config.json + model.safetensors map 1:1. Config parsing: models/t5_config.h. No parallel logic.
#pragma once

#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/attention.h"
#include "polytrain/models/model_output.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/models/t5_config.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {

/// HF T5LayerNorm: RMS norm (no mean subtraction, no bias), variance in fp32.
struct T5LayerNormImpl : torch::nn::Module {
  T5LayerNormImpl(int64_t size, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps_;
  /// Its output only feeds matrix products (the sublayers' norms; not the stacks' final norm):
  /// on a GPU under autocast the fused kernel writes it in the autocast dtype directly.
  bool feeds_gemms = false;
};
TORCH_MODULE(T5LayerNorm);

/// Multi-head attention without 1/sqrt(d) scaling (folded into q's init, as Mesh TensorFlow does).
/// Block 0 of each stack owns relative_attention_bias and computes the bias all blocks share.
struct T5AttentionImpl : torch::nn::Module {
  T5AttentionImpl(const T5Config& cfg, bool has_relative_attention_bias, bool bidirectional);
  /// x: [B, Lq, D]; kv: [B, Lk, D] (x itself for self-attention); bias: added to the scores,
  /// [1 or B, H, Lq, Lk] or [B, 1, 1, Lk] (position bias + mask), may be undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& kv, const at::Tensor& bias);
  /// [1, H, Lq, Lk] learned bias per relative-position bucket (needs relative_attention_bias).
  at::Tensor compute_bias(int64_t query_length, int64_t key_length) const;
  Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  Embedding relative_attention_bias{nullptr};  ///< [buckets, heads]; split by heads under tensor parallelism
  Dropout attn_dropout{nullptr};  ///< attention weights (F.dropout in HF): the tensor-parallel stream when split
  AttnImpl attn_impl_ = AttnImpl::kAuto;
  int64_t d_kv_, num_buckets_, max_distance_;  ///< the local head count is read from q's width
  bool bidirectional_;
  double dropout_;
};
TORCH_MODULE(T5Attention);

/// HF T5LayerSelfAttention (attr "SelfAttention") or T5LayerCrossAttention ("EncDecAttention"):
/// pre-norm, attention, dropout, residual.
struct T5LayerAttentionImpl : torch::nn::Module {
  T5LayerAttentionImpl(const T5Config& cfg, bool cross, bool has_relative_attention_bias, bool bidirectional);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& kv, const at::Tensor& bias);
  T5Attention attention{nullptr};
  T5LayerNorm layer_norm{nullptr};
  Dropout dropout{nullptr};
  bool cross_;
};
TORCH_MODULE(T5LayerAttention);

/// HF T5LayerFF: pre-norm, DenseReluDense (wi, wo; gated: wi_0, wi_1, wo), dropout, residual.
struct T5LayerFFImpl : torch::nn::Module {
  explicit T5LayerFFImpl(const T5Config& cfg);
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<torch::nn::Module> dense;  ///< "DenseReluDense"
  Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};
  T5LayerNorm layer_norm{nullptr};
  Dropout dropout{nullptr};
  Dropout act_dropout{nullptr};  ///< on d_ff (split under tensor parallelism: the region's stream)
  std::string act_;
  bool gated_;
};
TORCH_MODULE(T5LayerFF);

/// One block (HF T5Block): layer.0 self-attention, [decoder: layer.1 cross-attention], last FF.
/// The unit activation checkpointing recomputes.
struct T5BlockImpl : torch::nn::Module, LayerUnit {
  T5BlockImpl(const T5Config& cfg, bool is_decoder, bool has_relative_attention_bias);
  /// self_bias: position bias + self-attention mask; enc / enc_bias: encoder output and its
  /// padding mask (decoder only).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& self_bias, const at::Tensor& enc,
                     const at::Tensor& enc_bias);
  torch::nn::ModuleList layer{nullptr};
  T5LayerAttention self_attention{nullptr}, cross_attention{nullptr};
  T5LayerFF ff{nullptr};
};
TORCH_MODULE(T5Block);

/// HF T5Stack: embedding dropout, blocks, final_layer_norm, dropout. embed_tokens is the
/// model's `shared` embedding, used here but registered only there (HF leaves the tied copy out
/// of model.safetensors; registering it twice would also give the optimizer the matrix twice).
struct T5StackImpl : torch::nn::Module {
  T5StackImpl(const T5Config& cfg, bool is_decoder);
  /// embeds: [B, L, D]; self_mask: additive [B or 1, 1, 1 or L, L]; enc, enc_mask: decoder only.
  at::Tensor forward(const at::Tensor& embeds, const at::Tensor& self_mask, const at::Tensor& enc = {},
                     const at::Tensor& enc_mask = {});
  // forward's pieces, which the pipeline plan runs as its layers.
  /// Block 0's relative position bias for length len plus self_mask (may be undefined):
  /// [1 or B, H, len, len], what every block's self-attention adds to its scores.
  at::Tensor position_bias(int64_t len, const at::Tensor& self_mask);
  /// Block i on x: in_layer, and checkpointed when checkpoint_blocks is on in training.
  at::Tensor run_block(size_t i, const at::Tensor& x, const at::Tensor& self_bias, const at::Tensor& enc,
                       const at::Tensor& enc_mask);
  /// final_layer_norm and dropout: the stack's output.
  at::Tensor final_norm(const at::Tensor& x);
  torch::nn::ModuleList block{nullptr};
  T5LayerNorm final_layer_norm{nullptr};
  Dropout dropout{nullptr};
  bool is_decoder_;
  bool checkpoint_blocks = false;  ///< recompute each block in backward (models/activation_checkpoint.h)
};
TORCH_MODULE(T5Stack);

class T5ForConditionalGeneration;

/// HF T5ForConditionalGeneration; named_parameters() are HF's state_dict keys minus the tied copies.
struct T5ForConditionalGenerationImpl : torch::nn::Module, ActivationCheckpointing, TensorParallelPlanned,
                                        PipelinePlanned {
  explicit T5ForConditionalGenerationImpl(const T5Config& cfg);
  /// labels: [B, T], -100 = ignored. decoder_input_ids default: labels shifted right, starting with
  /// decoder_start_token_id, -100 replaced by pad_token_id (HF _shift_right). loss = mean CE over
  /// labels != -100. attention_mask (1 = token, 0 = padding) masks the encoder's self-attention
  /// and the cross-attention; the decoder is causal (HF's default without decoder_attention_mask).
  /// hidden_states: the decoder's output (before the tied-head rescaling).
  ModelOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                      const at::Tensor& labels = {}, const at::Tensor& decoder_input_ids = {});
  /// Checkpoints every encoder and decoder block.
  void set_activation_checkpointing(bool on) override;
  /// Megatron's split of every attention (q, k, v column; o row; relative bias by heads) and
  /// feed-forward (wi column; wo row), vocab-parallel shared embedding and LM head.
  TpPlan tensor_parallel_plan() const override;
  /// "encoder.embeddings" (shared), "encoder.block.N", "encoder.final_layer_norm" (the carry's
  /// "encoder_out" from here to the last decoder block), "decoder.embeddings" (shared again),
  /// "decoder.block.N", "head" (final norm, LM head, forward's loss). Block 0 of each stack
  /// computes the position bias (+ mask) and leaves it in the carry as "position_bias" for the
  /// stack's later blocks: a tensor its gradient flows back through to relative_attention_bias.
  /// Inputs: input_ids, labels, attention_mask and decoder_input_ids (optional, as in forward).
  /// The layers call into this model: the plan must not outlive it.
  PipelinePlan pipeline_plan() override;
  /// Re-draws every weight as HF's T5PreTrainedModel._init_weights (scaled by initializer_factor).
  void init_weights();
  /// HF _shift_right.
  at::Tensor shift_right(const at::Tensor& labels) const;
  /// dir/config.json + dir/model.safetensors with HF's names (tied copies left out, as HF does).
  void save_pretrained(const std::string& dir) const;
  /// Loads an HF T5 checkpoint directory (with or without the tied copies encoder/decoder.embed_tokens
  /// and, when tied, lm_head.weight). InputError naming the file and key on bad dir/config/weights.
  static T5ForConditionalGeneration from_pretrained(const std::string& dir);

  T5Config config_;
  Embedding shared{nullptr};
  T5Stack encoder{nullptr}, decoder{nullptr};
  Linear lm_head{nullptr};  ///< only when !tie_word_embeddings

 private:
  /// forward's input checks; the decoder's input ids (decoder_input_ids, or labels shifted right).
  at::Tensor decoder_ids(const at::Tensor& input_ids, const at::Tensor& attention_mask, const at::Tensor& labels,
                         const at::Tensor& decoder_input_ids) const;
  /// HF's extended padding mask in `dtype`: [B, 1, 1, L], 0 for tokens, finfo.min for padding
  /// (undefined without attention_mask).
  at::Tensor encoder_mask(const at::Tensor& attention_mask, c10::ScalarType dtype) const;
  /// The decoder's causal mask for embeddings `embeds` [B, T, D]: [1, 1, T, T], finfo.min above the diagonal.
  at::Tensor causal_mask(const at::Tensor& embeds) const;
  /// The LM head on the decoder's output: logits, and the loss when labels are given.
  ModelOutput lm_output(const at::Tensor& hidden, const at::Tensor& labels);
};
TORCH_MODULE(T5ForConditionalGeneration);

}  // namespace polytrain
