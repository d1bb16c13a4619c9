// Activation checkpointing: gradients equal the plain run's bit for bit on CPU fp32, with dropout
// on (the recomputation replays the forward's RNG state), under bf16 autocast too, nested in a
// larger graph, and eval / no-grad runs are unaffected.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "polytrain/common/config.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/bert.h"
#include "polytrain/common/autocast.h"

namespace polytrain {
namespace {

ModelConfig tiny(double dropout) {
  ModelConfig c;
  c.vocab_size = 120;
  c.hidden_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.intermediate_size = 64;
  c.max_position_embeddings = 32;
  c.hidden_dropout_prob = dropout;
  c.attention_probs_dropout_prob = dropout;
  return c;
}

struct Run {
  double loss;
  std::vector<at::Tensor> grads;
  double rng_after;  // a draw after backward: the RNG stream continues as in the plain run
};

Run run(bool checkpoint, bool bf16, double dropout) {
  torch::manual_seed(7);
  BertForMaskedLM model(tiny(dropout));
  model->set_activation_checkpointing(checkpoint);
  model->train();
  auto ids = torch::randint(5, 120, {4, 16});
  auto labels = torch::where(torch::rand({4, 16}) < 0.3, ids, torch::full_like(ids, -100));
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  at::Tensor loss;
  {
    std::unique_ptr<AutocastGuard> g;
    if (bf16) g = std::make_unique<AutocastGuard>(c10::kCPU, at::kBFloat16);
    loss = model->forward(ids, am, tt, labels).loss;
  }
  loss.backward();
  Run r{loss.item<double>(), {}, torch::rand({1}).item<double>()};
  for (auto& p : model->parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return r;
}

void expect_identical(const Run& a, const Run& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.rng_after, b.rng_after);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].defined(), b.grads[i].defined()) << i;
    if (a.grads[i].defined()) EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "parameter " << i;
  }
}

TEST(ActivationCheckpointing, BitExactGradientsWithDropout) {
  const auto plain = run(false, false, 0.1), ckpt = run(true, false, 0.1);
  expect_identical(plain, ckpt);
  // Not vacuous: with another dropout draw the gradients differ.
  const auto other = run(false, false, 0.2);
  EXPECT_FALSE(torch::equal(plain.grads[0], other.grads[0]));
}

// Under bf16 autocast the recomputed forward is identical (same loss, same RNG stream) and the
// gradients agree to bf16 rounding (the tied word embeddings add the decoder's and the
// embedding's gradients in another order); with fp32 everything above is bit-exact. Measured
// over all gradients together: some (attention key biases) are zero up to rounding noise.
TEST(ActivationCheckpointing, SameRunUnderBf16Autocast) {
  const auto a = run(false, true, 0.1), b = run(true, true, 0.1);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.rng_after, b.rng_after);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    if (!a.grads[i].defined()) continue;
    diff += (a.grads[i] - b.grads[i]).pow(2).sum().item<double>();
    norm += a.grads[i].pow(2).sum().item<double>();
  }
  std::printf("bf16: |grad(checkpointed) - grad(plain)| / |grad(plain)| = %.3g\n", std::sqrt(diff / norm));
  EXPECT_LT(std::sqrt(diff / norm), 1e-3);
}

TEST(ActivationCheckpointing, GenericBlockInsideALargerGraph) {
  torch::manual_seed(3);
  auto w = torch::randn({8, 8}).requires_grad_(true);
  auto x0 = torch::randn({5, 8}).requires_grad_(true);
  auto block = [&](const at::Tensor& h) { return torch::dropout(torch::tanh(h.mm(w)), 0.5, true).mm(w); };
  auto grads = [&](bool ckpt) {
    torch::manual_seed(11);
    w.mutable_grad() = at::Tensor();
    x0.mutable_grad() = at::Tensor();
    auto h = x0 * 2;
    auto y = ckpt ? checkpointed(block, h) : block(h);
    (y.sin().sum() + h.sum()).backward();
    return std::make_pair(w.grad().clone(), x0.grad().clone());
  };
  auto [w1, x1] = grads(false);
  auto [w2, x2] = grads(true);
  EXPECT_TRUE(torch::equal(w1, w2));
  EXPECT_TRUE(torch::equal(x1, x2));
  torch::NoGradGuard off;  // no grad: a plain call, nothing recorded
  EXPECT_FALSE(checkpointed(block, x0).requires_grad());
}

TEST(ActivationCheckpointing, EvalIsThePlainForward) {
  torch::manual_seed(1);
  BertForMaskedLM model(tiny(0.1));
  model->eval();
  auto ids = torch::randint(5, 120, {2, 16});
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  model->fused_lm_loss_ = false;
  auto a = model->forward(ids, am, tt).logits;
  model->set_activation_checkpointing(true);
  auto b = model->forward(ids, am, tt).logits;
  EXPECT_TRUE(torch::equal(a, b));
}

}  // namespace
}  // namespace polytrain
