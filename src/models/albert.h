// ALBERT masked-LM (and optionally its sentence-order-prediction head) in libtorch, after HF's
// modeling_albert.py: factorised embeddings, layers shared across groups. Parameter names are HF's
// state_dict keys, so save_pretrained / from_pretrained map 1:1 (models/hf_pretrained.h). The
// polytrain config's `model` section reaches here as raw JSON (ModelConfig::extra).
#pragma once

#include <string>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/albert_config.h"
#include "polytrain/models/model_output.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {


/// What AlbertForMaskedLM::forward returns: ModelOutput plus the SOP head's logits.
struct AlbertOutput : ModelOutput {
  at::Tensor sop_logits;  ///< [B, 2]; undefined without the SOP head
};

struct AlbertEmbeddingsImpl : torch::nn::Module {
  explicit AlbertEmbeddingsImpl(const AlbertConfig& cfg);
  /// [B, L] ids -> [B, L, embedding_size]
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids);
  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr}, token_type_embeddings{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  Dropout dropout{nullptr};
};
TORCH_MODULE(AlbertEmbeddings);

/// Self-attention with its output projection, residual and LayerNorm in one module (HF's layout).
struct AlbertAttentionImpl : torch::nn::Module {
  explicit AlbertAttentionImpl(const AlbertConfig& cfg);
  /// additive_mask: [B, 1, 1, L], 0 where attended, a large negative at padding (or undefined).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask);
  torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr}, dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  Dropout attention_dropout{nullptr}, output_dropout{nullptr};
  int64_t heads_, head_dim_;
};
TORCH_MODULE(AlbertAttention);

/// Attention, then ffn -> activation -> ffn_output, residual and full_layer_layer_norm.
struct AlbertLayerImpl : torch::nn::Module, LayerUnit {
  explicit AlbertLayerImpl(const AlbertConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask);
  torch::nn::LayerNorm full_layer_layer_norm{nullptr};
  AlbertAttention attention{nullptr};
  torch::nn::Linear ffn{nullptr}, ffn_output{nullptr};
  std::string act_;
};
TORCH_MODULE(AlbertLayer);

/// One parameter set: inner_group_num layers (albert_layers.N).
struct AlbertLayerGroupImpl : torch::nn::Module {
  explicit AlbertLayerGroupImpl(const AlbertConfig& cfg);
  torch::nn::ModuleList albert_layers{nullptr};
};
TORCH_MODULE(AlbertLayerGroup);

/// embedding_hidden_mapping_in, then num_hidden_layers applications of the groups: application i
/// uses group i / (num_hidden_layers / num_hidden_groups) (HF's AlbertTransformer).
struct AlbertTransformerImpl : torch::nn::Module {
  explicit AlbertTransformerImpl(const AlbertConfig& cfg);
  at::Tensor forward(const at::Tensor& embeddings, const at::Tensor& additive_mask);
  /// Application i (0 <= i < num_hidden_layers) of its group's layers on x: in_layer, and each
  /// layer checkpointed when checkpoint_layers is on in training.
  at::Tensor apply_group(int64_t i, at::Tensor x, const at::Tensor& additive_mask);
  /// Which group application i applies.
  int64_t group_of(int64_t i) const { return i / (num_hidden_layers_ / num_hidden_groups_); }
  torch::nn::Linear embedding_hidden_mapping_in{nullptr};
  torch::nn::ModuleList albert_layer_groups{nullptr};
  int64_t num_hidden_layers_, num_hidden_groups_;
  bool checkpoint_layers = false;  ///< recompute each layer application in backward
};
TORCH_MODULE(AlbertTransformer);

/// HF AlbertModel: embeddings + encoder, and the pooler when the SOP head is built.
struct AlbertModelImpl : torch::nn::Module {
  AlbertModelImpl(const AlbertConfig& cfg, bool add_pooling_layer);
  /// -> last hidden states [B, L, hidden_size]
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                     const at::Tensor& token_type_ids);
  /// The first group application's input (embeddings projected to hidden_size) and the additive
  /// padding mask ([B, 1, 1, L]; undefined without attention_mask): forward before the layers.
  std::pair<at::Tensor, at::Tensor> embed(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                          const at::Tensor& token_type_ids);
  /// tanh(pooler(hidden[:, 0])); needs the pooler.
  at::Tensor pool(const at::Tensor& hidden);
  AlbertEmbeddings embeddings{nullptr};
  AlbertTransformer encoder{nullptr};
  torch::nn::Linear pooler{nullptr};
};
TORCH_MODULE(AlbertModel);

/// HF AlbertMLMHead: dense (hidden -> embedding) + activation + LayerNorm, then the decoder onto
/// the vocabulary, its weight tied to the word embeddings (or its own `decoder.weight` when
/// tie_word_embeddings is false) and its bias `predictions.bias`.
struct AlbertMLMHeadImpl : torch::nn::Module {
  AlbertMLMHeadImpl(const AlbertConfig& cfg, const at::Tensor& word_embeddings);
  at::Tensor forward(const at::Tensor& hidden);
  at::Tensor transform(const at::Tensor& hidden);
  torch::nn::LayerNorm LayerNorm{nullptr};
  torch::nn::Linear dense{nullptr};
  at::Tensor bias;
  at::Tensor decoder_weight_;  ///< [vocab, embedding]: the word embeddings when tied (registered once)
  std::string act_;
};
TORCH_MODULE(AlbertMLMHead);

class AlbertForMaskedLM;  // TORCH_MODULE holder, defined below

/// ALBERT with the masked-LM head (HF AlbertForMaskedLM) and, when
/// AlbertConfig::sentence_order_prediction is set, the pooler and SOP head (HF AlbertForPreTraining).
struct AlbertForMaskedLMImpl : torch::nn::Module, ActivationCheckpointing, PipelinePlanned {
  explicit AlbertForMaskedLMImpl(const AlbertConfig& cfg);
  /// Checkpoints every layer application (a shared layer is recomputed once per use).
  void set_activation_checkpointing(bool on) override;
  /// "embeddings" (with embedding_hidden_mapping_in; carry "hidden" and the additive "mask"),
  /// "layer.N" per application of a layer group (num_hidden_layers of them; each lists its
  /// group's parameters, so a shared group appears in several layers), "head" (the MLM head, the
  /// pooler and SOP head when built, forward's loss). Inputs: input_ids, labels, attention_mask
  /// and token_type_ids (optional), sentence_order_label (read with the SOP head, as
  /// examples/train_albert.cpp passes it). The layers call into this model: the plan must not
  /// outlive it.
  PipelinePlan pipeline_plan() override;
  /// labels [B, L]: -100 where no prediction is wanted; sentence_order_label [B]: 0 in order,
  /// 1 swapped (needs the SOP head). loss = MLM cross-entropy (+ SOP cross-entropy when given).
  /// With labels and fused_lm_loss the logits are not formed (left undefined); with
  /// sparse_prediction they are [M, V] over labelled positions only.
  AlbertOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                       const at::Tensor& token_type_ids, const at::Tensor& labels = {},
                       const at::Tensor& sentence_order_label = {});
  /// Re-draws every weight as HF's _init_weights: N(0, initializer_range), zero biases and
  /// padding row, LayerNorm (1, 0).
  void init_weights(double initializer_range);

  /// HF layout: dir/config.json + dir/model.safetensors (tied decoder not written, as HF's
  /// safetensors save drops tied copies).
  void save_pretrained(const std::string& dir) const;
  /// Loads what save_pretrained or transformers wrote, also a bare AlbertModel checkpoint (no
  /// "albert." prefix; the heads then keep their fresh initialisation, as in HF). InputError
  /// naming the file for a missing/extra/misshapen tensor or a bad config value.
  static AlbertForMaskedLM from_pretrained(const std::string& dir);

  AlbertConfig config_;
  AlbertModel albert{nullptr};
  AlbertMLMHead predictions{nullptr};
  Dropout sop_dropout{nullptr};
  torch::nn::Linear sop_classifier{nullptr};  ///< registered as sop_classifier.classifier

 private:
  /// The heads on the encoder's output: forward's logits, SOP logits and loss.
  AlbertOutput heads(const at::Tensor& hidden, const at::Tensor& labels, const at::Tensor& sentence_order_label);
};
TORCH_MODULE(AlbertForMaskedLM);

}  // namespace polytrain
