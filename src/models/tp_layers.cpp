// Plain layers with torch::nn's math and initialisation (a model built from them draws the same
// random numbers as one built from torch::nn's), and the tensor-parallel forms of their forward.
#include "polytrain/models/tp_layers.h"

#include <cmath>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/models/cpu_dropout.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/tied_embedding.h"

namespace polytrain {

namespace F = torch::nn::functional;

at::Tensor TpShardable::tp_enter(const at::Tensor& x) const {
  if (!tp.sharded()) return x;
  if (tp.style == TpStyle::kColumn || tp.style == TpStyle::kVocab) return tp.region->copy_to(x);
  if (tp.style == TpStyle::kRow && !tp.input_is_parallel) return tp.region->scatter_last_dim(x);
  return x;
}

at::Tensor TpShardable::tp_leave(const at::Tensor& y, const at::Tensor& bias) const {
  if (!tp.sharded()) return y;
  if (tp.style == TpStyle::kRow) {
    auto out = tp.region->reduce_from(y);
    return bias.defined() ? out + bias : out;
  }
  if (tp.style == TpStyle::kColumn && tp.gather_output) return tp.region->gather_last_dim(y);
  return y;
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", torch::empty({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", torch::empty({out_features}));
  // torch::nn::Linear::reset_parameters, draw for draw.
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  const bool after = tp_bias_after();
  return tp_leave(F::linear(tp_enter(x), weight, after ? at::Tensor() : bias), after ? bias : at::Tensor());
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx_)
    : padding_idx(padding_idx_) {
  if (padding_idx && *padding_idx < 0) padding_idx = *padding_idx + num_embeddings;
  PT_CHECK(!padding_idx || (*padding_idx >= 0 && *padding_idx < num_embeddings), "Embedding: padding_idx ",
           *padding_idx, " out of range for ", num_embeddings, " embeddings");
  weight = register_parameter("weight", torch::empty({num_embeddings, embedding_dim}));
  // torch::nn::Embedding::reset_parameters.
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(weight);
  if (padding_idx) weight[*padding_idx].fill_(0);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
  if (!(tp.sharded() && tp.style == TpStyle::kVocab)) return tied_embedding::lookup(weight, ids, padding_idx.value_or(-1));
  // VocabParallelEmbedding: this rank's rows, zeros for ids another rank owns, summed over ranks.
  const int64_t begin = tp.vocab_begin, end = tp.vocab_begin + tp.vocab_valid;
  auto outside = ids.lt(begin).logical_or(ids.ge(end));
  auto local = (ids - begin).masked_fill(outside, 0);
  int64_t pad = -1;
  if (padding_idx && *padding_idx >= begin && *padding_idx < end) pad = *padding_idx - begin;
  auto out = torch::embedding(weight, local, pad).masked_fill(outside.unsqueeze(-1), 0.0);
  return tp.region->reduce_from(out);
}

DropoutImpl::DropoutImpl(double p_) : p(p_) {
  PT_CHECK(p >= 0.0 && p <= 1.0, "Dropout: probability must be in [0, 1], got ", p);
}

at::Tensor DropoutImpl::forward(const at::Tensor& x) {
  if (!is_training() || p == 0.0) return x;
  if (x.device().is_cpu()) return cpu_dropout(x, p, generator ? &*generator : nullptr);
  if (!generator) return torch::dropout(x, p, true);
  if (p == 1.0) return x * at::zeros_like(x);
  // ATen's _dropout_impl (bernoulli(1 - p) / (1 - p) times x) with the region's generator.
  auto noise = at::empty_like(x).bernoulli_(1.0 - p, *generator);
  noise.div_(1.0 - p);
  return x * noise;
}

at::Tensor lm_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const TpSlot& vocab) {
  if (!vocab.sharded()) return F::linear(hidden, weight, bias);
  auto local = F::linear(vocab.region->copy_to(hidden), weight, bias);
  auto full = vocab.region->gather_last_dim(local);
  return full.size(-1) == vocab.vocab_size ? full : full.narrow(-1, 0, vocab.vocab_size);
}

at::Tensor lm_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                   const at::Tensor& labels, const TpSlot& vocab, int64_t ignore_index) {
  if (!vocab.sharded()) return fused_linear_cross_entropy(hidden, weight, bias, labels, ignore_index);
  auto h = vocab.region->copy_to(hidden.reshape({-1, hidden.size(-1)}));
  auto local = F::linear(h, weight, bias);
  return vocab.region->vocab_cross_entropy(local, labels.reshape({-1}), vocab.vocab_begin, vocab.vocab_valid,
                                           ignore_index);
}

}  // namespace polytrain
