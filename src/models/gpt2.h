// GPT-2 causal LM in libtorch (HF modeling_gpt2.py's math), with HF's parameter names
// (transformer.wte.weight, transformer.h.0.attn.c_attn.weight, ...) and HF's Conv1D layout
// ([in, out] weights), so an HF checkpoint maps 1:1. No parallel logic (principle 2).
#pragma once

#include <string>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/models/attention.h"
#include "polytrain/models/gpt2_config.h"
#include "polytrain/models/model_output.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {


/// HF's Conv1D: y = x W + b with W stored [in, out] (the transpose of a Linear's); splits like
/// a Linear along its output dim 1.
struct Gpt2Conv1DImpl : torch::nn::Module, TpShardable {
  Gpt2Conv1DImpl(int64_t in, int64_t out);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor tp_weight() const override { return weight; }
  at::Tensor tp_bias() const override { return bias; }
  int64_t tp_out_dim() const override { return 1; }
  at::Tensor weight, bias;
};
TORCH_MODULE(Gpt2Conv1D);

struct Gpt2AttentionImpl : torch::nn::Module {
  Gpt2AttentionImpl(const Gpt2Config& cfg, int64_t layer_idx);
  /// masked: bool [B or 1, 1, L, L], true where query i must not attend key j (causal + padding).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& masked);
  Gpt2Conv1D c_attn{nullptr}, c_proj{nullptr};
  Dropout attn_dropout{nullptr};  ///< on this rank's heads: the tensor-parallel stream when split
  Dropout resid_dropout{nullptr};
  int64_t head_dim_;  ///< the local head count is read from c_attn's width
  AttnImpl attn_impl_;
  double scale_;
};
TORCH_MODULE(Gpt2Attention);

struct Gpt2MlpImpl : torch::nn::Module {
  explicit Gpt2MlpImpl(const Gpt2Config& cfg);
  at::Tensor forward(const at::Tensor& x);
  Gpt2Conv1D c_fc{nullptr}, c_proj{nullptr};
  Dropout dropout{nullptr};
  std::string act_;
};
TORCH_MODULE(Gpt2Mlp);

/// Pre-LayerNorm block: x + attn(ln_1(x)), then + mlp(ln_2(.)). The checkpointing unit.
struct Gpt2BlockImpl : torch::nn::Module, LayerUnit {
  Gpt2BlockImpl(const Gpt2Config& cfg, int64_t layer_idx);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& masked);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Gpt2Attention attn{nullptr};
  Gpt2Mlp mlp{nullptr};
};
TORCH_MODULE(Gpt2Block);

/// HF GPT2Model: embeddings, blocks, final LayerNorm.
struct Gpt2ModelImpl : torch::nn::Module {
  explicit Gpt2ModelImpl(const Gpt2Config& cfg);
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask);
  // forward's pieces, which the pipeline plan runs as its layers.
  /// The blocks' input (dropout(wte + wpe)) and the mask they read: bool [B or 1, 1, L, L], true
  /// where query i may not see key j (a later position, or padding).
  std::pair<at::Tensor, at::Tensor> embed(const at::Tensor& input_ids, const at::Tensor& attention_mask);
  /// Block i on x: in_layer, and checkpointed when checkpoint_blocks is on in training.
  at::Tensor run_block(size_t i, const at::Tensor& x, const at::Tensor& masked);
  /// ln_f: the hidden states forward returns.
  at::Tensor final_norm(const at::Tensor& x);
  Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  bool checkpoint_blocks = false;

 private:
  /// The blocks with each residual add and the LayerNorm after it in one kernel (ops/cuda_ops.h):
  /// a GPU, fp32 residual stream, no activation checkpointing.
  at::Tensor fused_blocks(at::Tensor x, const at::Tensor& masked);
};
TORCH_MODULE(Gpt2Model);

/// HF GPT2LMHeadModel: "transformer" + an LM head tied to wte (or its own lm_head.weight when
/// tie_word_embeddings is false).
struct Gpt2LMHeadModelImpl : torch::nn::Module, ActivationCheckpointing, TensorParallelPlanned, PipelinePlanned {
  explicit Gpt2LMHeadModelImpl(const Gpt2Config& cfg);
  /// input_ids [B, L]; attention_mask [B, L] 1/0 or undefined; labels [B, L] (usually the
  /// input ids; -100 = ignored): the loss is HF's, token t predicts labels[t + 1].
  ModelOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                      const at::Tensor& labels = {});
  void set_activation_checkpointing(bool on) override;
  /// Megatron's GPT split: vocab-parallel wte (and LM head), c_attn column-parallel per q/k/v
  /// block, c_fc column, both c_proj row, attention dropout on the per-rank stream.
  TpPlan tensor_parallel_plan() const override;
  /// "embeddings" (wte, wpe, drop; carry "hidden" and the bool attention mask "mask"), "h.N" per block,
  /// "head" (ln_f, the LM head, forward's loss). Inputs: input_ids, labels, attention_mask
  /// (optional). The plain blocks always: the fused CUDA block path is forward's alone. The
  /// layers call into this model: the plan must not outlive it.
  PipelinePlan pipeline_plan() override;
  /// HF's _init_weights: N(0, initializer_range), c_proj weights N(0, range / sqrt(2 n_layer)).
  void init_weights();
  /// The [V, H] output projection (wte's weight when tied).
  at::Tensor lm_head_weight() const;
  /// How the output projection is split (wte's slot when tied).
  const TpSlot& lm_head_slot() const;

  /// config.json + model.safetensors in HF's layout (the tied lm_head is not written, as HF).
  void save_pretrained(const std::string& dir) const;
  /// From an HF GPT-2 directory (GPT2LMHeadModel or bare GPT2Model checkpoints; the attn.bias
  /// mask buffers of old checkpoints are ignored).
  static std::shared_ptr<Gpt2LMHeadModelImpl> from_pretrained(const std::string& dir);

  Gpt2Config config_;
  Gpt2Model transformer{nullptr};
  Linear lm_head{nullptr};  ///< only when untied (lm_head.weight)

 private:
  /// The LM head on the final hidden states: logits, and the loss when labels are given.
  ModelOutput lm_output(const at::Tensor& hidden, const at::Tensor& labels);
};
TORCH_MODULE(Gpt2LMHeadModel);

}  // namespace polytrain
