// BERT / RoBERTa masked-LM in libtorch, parameter names identical to Hugging Face's
// (bert.embeddings.word_embeddings.weight, ..., cls.predictions.bias), so weights map 1:1.
// No parallel logic here: backends transform the built model (principle 2).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"
#include "polytrain/models/bert_config.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/attention.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/model_output.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {


struct BertEmbeddingsImpl : torch::nn::Module {
  explicit BertEmbeddingsImpl(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids);
  Embedding word_embeddings{nullptr};
  torch::nn::Embedding position_embeddings{nullptr},
      token_type_embeddings{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  Dropout dropout{nullptr};
  int64_t position_offset_ = 0;  ///< RoBERTa counts positions from pad_token_id + 1
};
TORCH_MODULE(BertEmbeddings);

/// Multi-head self-attention (HF: attention.self + attention.output).
struct BertSelfAttentionImpl : torch::nn::Module {
  explicit BertSelfAttentionImpl(const ModelConfig& cfg);
  /// additive_mask: [B, 1, 1, L], 0 for tokens to attend, a large negative for padding.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask);
  Linear query{nullptr}, key{nullptr}, value{nullptr};
  Dropout dropout{nullptr};  ///< attention probabilities: the tensor-parallel stream when split
  int64_t head_dim_;         ///< the local head count is read from the projections' width
  AttnImpl attn_impl_;
};
TORCH_MODULE(BertSelfAttention);

/// Dense + dropout + residual + LayerNorm (HF: BertSelfOutput / BertOutput).
struct BertOutputImpl : torch::nn::Module {
  BertOutputImpl(int64_t in, int64_t out, const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual);
  Linear dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  Dropout dropout{nullptr};
};
TORCH_MODULE(BertOutput);

struct BertAttentionImpl : torch::nn::Module {
  explicit BertAttentionImpl(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask);
  BertSelfAttention self{nullptr};
  BertOutput output{nullptr};
};
TORCH_MODULE(BertAttention);

struct BertIntermediateImpl : torch::nn::Module {
  explicit BertIntermediateImpl(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  Linear dense{nullptr};
  std::string act_;
};
TORCH_MODULE(BertIntermediate);

/// One transformer block: the unit activation checkpointing and tensor parallelism act on.
struct BertLayerImpl : torch::nn::Module, LayerUnit {
  explicit BertLayerImpl(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask);
  BertAttention attention{nullptr};
  BertIntermediate intermediate{nullptr};
  BertOutput output{nullptr};
};
TORCH_MODULE(BertLayer);

struct BertEncoderImpl : torch::nn::Module {
  explicit BertEncoderImpl(const ModelConfig& cfg);
  at::Tensor forward(at::Tensor x, const at::Tensor& additive_mask);
  /// Layer i on x: in_layer, and checkpointed when checkpoint_layers is on in training.
  at::Tensor run_layer(size_t i, const at::Tensor& x, const at::Tensor& additive_mask);
  torch::nn::ModuleList layer{nullptr};
  bool checkpoint_layers = false;  ///< recompute each layer in backward (models/activation_checkpoint.h)
};
TORCH_MODULE(BertEncoder);

/// Encoder without heads (HF BertModel without the pooler).
struct BertModelImpl : torch::nn::Module {
  explicit BertModelImpl(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                     const at::Tensor& token_type_ids);
  /// The encoder's input and its additive padding mask ([B, 1, 1, L]; undefined without
  /// attention_mask): forward's first half, a pipeline plan's first layer.
  std::pair<at::Tensor, at::Tensor> embed(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                          const at::Tensor& token_type_ids);
  BertEmbeddings embeddings{nullptr};
  BertEncoder encoder{nullptr};
};
TORCH_MODULE(BertModel);

/// HF BertLMPredictionHead / RobertaLMHead: transform, then a decoder tied to the word embeddings.
struct BertLMHeadImpl : torch::nn::Module {
  BertLMHeadImpl(const ModelConfig& cfg, Embedding word_embeddings);
  at::Tensor forward(const at::Tensor& hidden);
  /// dense + activation + LayerNorm: the hidden states the tied decoder projects.
  at::Tensor transform(const at::Tensor& hidden);
  torch::nn::Linear dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  at::Tensor decoder_weight_;  ///< tied: the word embedding matrix (not registered twice)
  Embedding decoder_{nullptr};  ///< the word embeddings (not registered here): how the decoder is split
  at::Tensor bias;
  std::string act_;
};
TORCH_MODULE(BertLMHead);


class BertForMaskedLM;  // TORCH_MODULE holder, defined below

/// BERT (or RoBERTa, by model_type) with the masked-LM head. Parameter names are HF's:
/// bert.* + cls.predictions.* for BERT, roberta.* + lm_head.* for RoBERTa.
struct BertForMaskedLMImpl : torch::nn::Module, ActivationCheckpointing, TensorParallelPlanned, PipelinePlanned {
  explicit BertForMaskedLMImpl(const ModelConfig& cfg);
  /// Checkpoints every encoder layer (the embeddings and the head are kept).
  void set_activation_checkpointing(bool on) override;
  /// Megatron's BERT split: vocab-parallel word embeddings and decoder (bias included),
  /// query/key/value and intermediate column-parallel, both output denses row-parallel.
  TpPlan tensor_parallel_plan() const override;
  /// "embeddings" (carry "hidden" and the additive "mask"), "layer.N" per encoder layer, "head"
  /// (the MLM head, its decoder the word embeddings, and forward's loss). Inputs: input_ids,
  /// labels, attention_mask and token_type_ids (both optional, as in forward). The layers call
  /// into this model: the plan must not outlive it.
  PipelinePlan pipeline_plan() override;
  /// labels: -100 where no prediction is wanted. When score_masked_only is set, logits are
  /// computed only at labelled positions (same loss, less work; NVIDIA/Megatron BERT do this).
  /// When fused_lm_loss is set and labels are given, the loss is computed without the [N, V]
  /// logits (models/fused_lm_loss.h) and ModelOutput::logits is left undefined.
  ModelOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                      const at::Tensor& token_type_ids, const at::Tensor& labels = {});
  /// Re-draws every weight from N(0, initializer_range) as HF's _init_weights does.
  void init_weights(double initializer_range);

  /// HF layout: dir/config.json + dir/model.safetensors (the tied decoder is not written, as
  /// HF's safetensors save drops tied copies).
  void save_pretrained(const std::string& dir) const;
  /// Loads what save_pretrained or transformers wrote (BertForMaskedLM / RobertaForMaskedLM, also
  /// BertForPreTraining, whose NSP head and pooler are ignored, and a bare BertModel/RobertaModel
  /// whose names lack the "bert."/"roberta." prefix: the head then keeps its fresh
  /// initialisation, as in HF). InputError naming the file for a bad config value or a
  /// missing, unexpected or misshapen tensor.
  static BertForMaskedLM from_pretrained(const std::string& dir);

  ModelConfig config_;
  bool score_masked_only_ = false;
  bool fused_lm_loss_ = true;
  BertModel encoder_model{nullptr};  ///< registered as "bert" or "roberta"
  BertLMHead lm_head{nullptr};       ///< registered as "cls.predictions" path or "lm_head"

 private:
  /// The MLM head on the encoder's output: the loss (with labels) and logits as forward returns them.
  LmHeadOutput mlm_output(const at::Tensor& hidden, const at::Tensor& labels);
};
TORCH_MODULE(BertForMaskedLM);

}  // namespace polytrain
