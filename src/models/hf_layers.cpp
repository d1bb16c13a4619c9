#include "polytrain/models/hf_layers.h"

#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/error.h"
#include "polytrain/models/tp_layers.h"
#include "polytrain/ops/cpu_ops.h"

namespace polytrain {

at::Tensor hf_activation(const std::string& a, const at::Tensor& x, const char* key) {
  if (a == "gelu") return torch::gelu(x);
  if (a == "gelu_new" || a == "gelu_pytorch_tanh") return cpu_ops::handles(x) ? cpu_ops::gelu_tanh(x) : torch::gelu(x, "tanh");
  // FastGELUActivation: the tanh approximation with its own constant folding.
  if (a == "gelu_fast") return 0.5 * x * (1.0 + torch::tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)));
  if (a == "relu") return torch::relu(x);
  if (a == "silu" || a == "swish") return torch::silu(x);
  if (a == "tanh") return torch::tanh(x);
  check_hf_activation(a, key);
  return x;  // unreachable
}

at::Tensor norm_in_weight_dtype(torch::nn::LayerNorm& ln, const at::Tensor& x) {
  const auto t = ln->weight.scalar_type();
  if (x.scalar_type() == t) return ln(x);
  // Under autocast the fp32 result goes on (autocast casts it where needed); in a model cast to
  // half with its normalization layers kept fp32 (amp O2), the result returns to the
  // activations' type, as Apex's fp32 BatchNorm does.
  if (autocast_type(x.device().type())) return ln(x.to(t));
  return ln(x.to(t)).to(x.scalar_type());
}

at::Tensor extended_attention_mask(const at::Tensor& mask, c10::ScalarType dtype) {
  if (!mask.defined()) return {};
  auto m = mask.to(torch::kFloat).unsqueeze(1).unsqueeze(2);
  return ((1.0 - m) * -10000.0).to(dtype);
}

void init_hf_weights(torch::nn::Module& model, double std) {
  torch::NoGradGuard no_grad;
  for (auto& m : model.modules(/*include_self=*/false)) {
    if (auto* lin = m->as<torch::nn::Linear>()) {
      lin->weight.normal_(0.0, std);
      if (lin->bias.defined()) lin->bias.zero_();
    } else if (auto* plin = m->as<LinearImpl>()) {
      plin->weight.normal_(0.0, std);
      if (plin->bias.defined()) plin->bias.zero_();
    } else if (auto* emb = m->as<torch::nn::Embedding>()) {
      emb->weight.normal_(0.0, std);
      if (emb->options.padding_idx()) emb->weight[*emb->options.padding_idx()].zero_();
    } else if (auto* pemb = m->as<EmbeddingImpl>()) {
      pemb->weight.normal_(0.0, std);
      if (pemb->padding_idx) pemb->weight[*pemb->padding_idx].zero_();
    } else if (auto* ln = m->as<torch::nn::LayerNorm>()) {
      ln->weight.fill_(1.0);
      ln->bias.zero_();
    }
  }
}

}  // namespace polytrain
