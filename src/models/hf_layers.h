// Pieces every Hugging Face model family here shares: transformers' ACT2FN by name, LayerNorm
// run in its weights' dtype under autocast, and HF's default _init_weights for Linear /
// Embedding / LayerNorm submodules. The families keep their own layers and special cases.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>

#include "polytrain/models/hf_config.h"

namespace polytrain {

/// transformers' ACT2FN[name](x): gelu, gelu_new / gelu_pytorch_tanh (tanh approximation),
/// gelu_fast, relu, silu / swish, tanh. InputError "<key>: unsupported activation ..." otherwise.
at::Tensor hf_activation(const std::string& name, const at::Tensor& x, const char* key = "model.hidden_act");

/// ln(x) in ln's weight dtype: fp32 under fp16/bf16 autocast, as autocast's fp32 list does on
/// CUDA (LibTorch 1.13's CPU kernel rejects a bf16 input with fp32 weights).
at::Tensor norm_in_weight_dtype(torch::nn::LayerNorm& ln, const at::Tensor& x);

/// HF's extended attention mask: [B, L] 1/0 -> [B, 1, 1, L] 0/-10000 in `dtype`, the
/// activations' type (fp32 under autocast, the model's half type when amp O2 / O3 cast it);
/// undefined when `mask` is.
at::Tensor extended_attention_mask(const at::Tensor& mask, c10::ScalarType dtype);

/// HF's _init_weights over every submodule of `model`: Linear and Embedding weights from
/// N(0, std) (the padding row zeroed), biases zero, LayerNorm weight 1 and bias 0.
void init_hf_weights(torch::nn::Module& model, double std);

}  // namespace polytrain
