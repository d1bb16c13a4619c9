// attn_implementation (models/attention.h): sdpa gives the eager path's loss and gradients
// for GPT-2 (causal alone, and causal + right padding), BERT (padding) and T5 (relative bias +
// padding, causal decoder, cross-attention), bad values are InputErrors naming the key, and
// "auto" keeps the exact path on the CPU except GPT-2's causal attention, which runs the fused
// CPU kernel (in fp32, also under bf16 autocast) with the eager path's dropout mask. On a GPU the same switch picks the fused
// kernels; bench/gpu_step.sh compares 200-step loss curves there.
#include <algorithm>
#include <set>
#include <vector>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/attention.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/gpt2_config.h"
#include "polytrain/models/t5.h"
#include "polytrain/models/t5_config.h"

namespace polytrain {
namespace {

// Loss and every gradient of `b` within float rounding of `a`'s.
void expect_same(torch::nn::Module& a, at::Tensor la, torch::nn::Module& b, at::Tensor lb) {
  EXPECT_NEAR(la.item<double>(), lb.item<double>(), 1e-5 * std::abs(la.item<double>()));
  la.backward();
  lb.backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  // Against the largest gradient of the model: some are zero analytically (a key bias shifts
  // every score of a row alike) and only rounding noise is left to compare there.
  double scale = 1e-12;
  for (const auto& p : pa)
    if (p.value().grad().defined()) scale = std::max(scale, p.value().grad().abs().max().item<double>());
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto& ga = pa[i].value().grad();
    const auto& gb = pb[i].value().grad();
    if (!ga.defined()) {
      EXPECT_FALSE(gb.defined()) << pa[i].key();
      continue;
    }
    ASSERT_TRUE(gb.defined()) << pa[i].key();
    EXPECT_LT((ga - gb).abs().max().item<double>() / scale, 1e-4) << pa[i].key();
  }
}

Gpt2Config gpt2_tiny(const std::string& impl) {
  Gpt2Config c;
  c.vocab_size = 97, c.n_positions = 32, c.n_embd = 32, c.n_layer = 2, c.n_head = 4;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
  c.attn_implementation = impl;
  return c;
}

TEST(Attention, Gpt2SdpaMatchesEagerCausalAndPadded) {
  for (bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "right padding" : "causal only");
    torch::manual_seed(3);
    Gpt2LMHeadModel eager(gpt2_tiny("eager"));
    torch::manual_seed(3);
    Gpt2LMHeadModel sdpa(gpt2_tiny("sdpa"));
    auto ids = torch::randint(0, 97, {3, 16}, torch::kLong);
    at::Tensor mask;
    if (padded) {
      mask = torch::ones({3, 16}, torch::kLong);
      // Right padding, as batches are padded here. (Left padding gives a query with every key
      // masked: eager's masked_fill then passes no gradient into that row's scores, an
      // additive mask does; the forward values agree.)
      mask.index_put_({1, torch::indexing::Slice(11, 16)}, 0);
    }
    auto labels = ids.clone();
    if (padded) labels.masked_fill_(mask.eq(0), -100);
    expect_same(*eager, eager->forward(ids, mask, labels).loss, *sdpa, sdpa->forward(ids, mask, labels).loss);
  }
}

// Whether the autograd graph behind `t` has a node whose name contains `name`.
bool graph_has(const at::Tensor& t, const std::string& name) {
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (!n || !seen.insert(n).second) continue;
    if (n->name().find(name) != std::string::npos) return true;
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return false;
}

TEST(Attention, Gpt2AutoOnTheCpuIsTheFusedCausalKernelWithTheEagerDropout) {
  for (const double p : {0.0, 0.2}) {
    SCOPED_TRACE("dropout " + std::to_string(p));
    auto ce = gpt2_tiny("eager"), ca = gpt2_tiny("auto");
    ce.resid_pdrop = ce.embd_pdrop = ce.attn_pdrop = ca.resid_pdrop = ca.embd_pdrop = ca.attn_pdrop = p;
    torch::manual_seed(3);
    Gpt2LMHeadModel eager(ce);
    torch::manual_seed(3);
    Gpt2LMHeadModel fused(ca);
    auto ids = torch::randint(0, 97, {3, 16}, torch::kLong);
    // The same draws in the same order: every dropout mask, the attention's included, is the same.
    torch::manual_seed(9);
    auto le = eager->forward(ids, {}, ids).loss;
    torch::manual_seed(9);
    auto la = fused->forward(ids, {}, ids).loss;
    EXPECT_TRUE(graph_has(la, "CausalAttentionFn"));
    EXPECT_FALSE(graph_has(le, "CausalAttentionFn"));
    expect_same(*eager, le, *fused, la);
  }
  // Under bf16 autocast the kernel runs in fp32 on the upcast projection: the eager path's loss
  // to bf16 rounding.
  {
    torch::manual_seed(3);
    Gpt2LMHeadModel eager(gpt2_tiny("eager"));
    torch::manual_seed(3);
    Gpt2LMHeadModel fused(gpt2_tiny("auto"));
    auto ids = torch::randint(0, 97, {3, 16}, torch::kLong);
    AutocastGuard bf16(c10::DeviceType::CPU, c10::kBFloat16);
    auto le = eager->forward(ids, {}, ids).loss, la = fused->forward(ids, {}, ids).loss;
    EXPECT_TRUE(graph_has(la, "CausalAttentionFn"));
    EXPECT_NEAR(la.item<double>(), le.item<double>(), 2e-2 * std::abs(le.item<double>()));
  }
  // With padding, auto keeps the eager path.
  torch::manual_seed(3);
  Gpt2LMHeadModel model(gpt2_tiny("auto"));
  auto ids = torch::randint(0, 97, {2, 8}, torch::kLong);
  auto mask = torch::ones({2, 8}, torch::kLong);
  mask.index_put_({1, torch::indexing::Slice(6, 8)}, 0);
  EXPECT_FALSE(graph_has(model->forward(ids, mask, ids).loss, "CausalAttentionFn"));
}

TEST(Attention, BertSdpaMatchesEagerWithPadding) {
  ModelConfig c;
  c.vocab_size = 120, c.hidden_size = 32, c.num_hidden_layers = 2, c.num_attention_heads = 4;
  c.intermediate_size = 64, c.max_position_embeddings = 32;
  c.hidden_dropout_prob = c.attention_probs_dropout_prob = 0.0;
  c.attn_implementation = "eager";
  torch::manual_seed(5);
  BertForMaskedLM eager(c);
  c.attn_implementation = "sdpa";
  torch::manual_seed(5);
  BertForMaskedLM sdpa(c);
  auto ids = torch::randint(5, 120, {2, 12}, torch::kLong);
  auto mask = torch::ones({2, 12}, torch::kLong);
  mask.index_put_({0, torch::indexing::Slice(8, 12)}, 0);
  auto labels = torch::where(torch::rand({2, 12}) < 0.3, ids, torch::full_like(ids, -100));
  labels.index_put_({0, 1}, 7);
  auto tt = torch::zeros_like(ids);
  expect_same(*eager, eager->forward(ids, mask, tt, labels).loss, *sdpa, sdpa->forward(ids, mask, tt, labels).loss);
}

TEST(Attention, T5SdpaMatchesEagerWithRelativeBiasAndPadding) {
  T5Config c;
  c.vocab_size = 64, c.d_model = 32, c.d_kv = 8, c.d_ff = 64, c.num_layers = 2, c.num_heads = 4;
  c.dropout_rate = 0.0;
  c.attn_implementation = "eager";
  torch::manual_seed(7);
  T5ForConditionalGeneration eager(c);
  c.attn_implementation = "sdpa";
  torch::manual_seed(7);
  T5ForConditionalGeneration sdpa(c);
  auto ids = torch::randint(2, 64, {2, 10}, torch::kLong);
  auto mask = torch::ones({2, 10}, torch::kLong);
  mask.index_put_({1, torch::indexing::Slice(6, 10)}, 0);
  auto labels = torch::randint(2, 64, {2, 6}, torch::kLong);
  expect_same(*eager, eager->forward(ids, mask, labels).loss, *sdpa, sdpa->forward(ids, mask, labels).loss);
}

TEST(Attention, BadValueIsAnInputErrorAndAutoStaysExactOnTheCpu) {
  try {
    gpt2_config_from_json(nlohmann::json{{"attn_implementation", "flash"}}, "gpt2.json");
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("attn_implementation"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("flash"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t5_config_from_json(nlohmann::json{{"attn_implementation", 3}}, "t5.json"), InputError);
  const auto bert = config_from_json(nlohmann::json{{"train_batch_size", 1}, {"model", {{"attn_implementation", "x"}}}},
                                     "bert.json");
  EXPECT_THROW(BertForMaskedLM{bert.model}, InputError);
  DropoutImpl dropout(0.1);
  const auto cpu = torch::zeros({1, 1, 2, 2});
  EXPECT_FALSE(use_sdpa(AttnImpl::kAuto, cpu, dropout));
  EXPECT_FALSE(use_sdpa(AttnImpl::kEager, cpu, dropout));
  EXPECT_TRUE(use_sdpa(AttnImpl::kSdpa, cpu, dropout));
  // A tensor-parallel region's own dropout stream keeps the eager path while training.
  dropout.generator = at::detail::createCPUGenerator(1);
  EXPECT_FALSE(use_sdpa(AttnImpl::kSdpa, cpu, dropout));
  dropout.eval();
  EXPECT_TRUE(use_sdpa(AttnImpl::kSdpa, cpu, dropout));
}

}  // namespace
}  // namespace polytrain
