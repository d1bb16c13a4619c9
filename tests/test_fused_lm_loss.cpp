// fused_linear_cross_entropy against linear + cross_entropy: loss and all three gradients,
// with and without bias, ignored rows, chunk sizes that do / do not divide the row count,
// a scaled upstream gradient, no-grad evaluation, and BertForMaskedLM's three head paths.
#include <string>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/tied_embedding.h"
#include "polytrain/models/tp_layers.h"
#include "polytrain/ops/cpu_gemm.h"

using namespace polytrain;
namespace F = torch::nn::functional;

namespace {

struct Case {
  bool bias;
  int64_t chunk;
  double ignored_fraction;
  int64_t pad = 0;  ///< pad_vocab_to (0: none on the CPU)
};
// What ctest shows after the case's name (CMake 3.25 puts GetParam()'s print into it).
void PrintTo(const Case& c, std::ostream* os) {
  *os << "bias " << c.bias << " chunk " << c.chunk << " ignored " << c.ignored_fraction << " pad " << c.pad;
}

class FusedLmLoss : public ::testing::TestWithParam<Case> {};

TEST_P(FusedLmLoss, MatchesDenseLossAndGradients) {
  const auto c = GetParam();
  torch::manual_seed(3);
  const int64_t b = 3, l = 7, hsz = 16, v = 101;
  auto h0 = torch::randn({b, l, hsz}, torch::kDouble);
  auto w0 = torch::randn({v, hsz}, torch::kDouble) * 0.5;
  auto b0 = torch::randn({v}, torch::kDouble);
  auto labels = torch::randint(0, v, {b, l}, torch::kLong);
  labels.masked_fill_(torch::rand({b, l}) < c.ignored_fraction, -100);
  labels[0][0] = 5;  // at least one labelled row
  auto run = [&](bool fused) {
    auto h = h0.clone().requires_grad_(true);
    auto w = w0.clone().requires_grad_(true);
    auto bb = c.bias ? b0.clone().requires_grad_(true) : at::Tensor();
    at::Tensor loss;
    if (fused) {
      loss = fused_linear_cross_entropy(h, w, bb, labels, -100, c.chunk, std::nullopt, c.pad);
    } else {
      auto logits = F::linear(h, w, bb);
      loss = F::cross_entropy(logits.reshape({-1, v}), labels.reshape({-1}),
                              F::CrossEntropyFuncOptions().ignore_index(-100));
    }
    (loss * 2.5).backward();  // an upstream gradient other than 1
    return std::make_tuple(loss.detach(), h.grad(), w.grad(), c.bias ? bb.grad() : at::Tensor());
  };
  auto [lf, hf, wf, bf] = run(true);
  auto [ld, hd, wd, bd] = run(false);
  EXPECT_NEAR(lf.item<double>(), ld.item<double>(), 1e-12);
  EXPECT_TRUE(torch::allclose(hf, hd, 1e-10, 1e-12));
  EXPECT_TRUE(torch::allclose(wf, wd, 1e-10, 1e-12));
  if (c.bias) EXPECT_TRUE(torch::allclose(bf, bd, 1e-10, 1e-12));
  EXPECT_EQ(hf.sizes(), h0.sizes());
  // Ignored rows get exactly zero gradient.
  auto ignored = labels.reshape({-1}).eq(-100);
  if (ignored.any().item<bool>()) {
    EXPECT_EQ(hf.reshape({-1, hsz}).index({ignored}).abs().max().item<double>(), 0.0);
  }
  // Without autograd the same value comes back.
  torch::NoGradGuard ng;
  auto lng = fused_linear_cross_entropy(h0, w0, c.bias ? b0 : at::Tensor(), labels, -100, c.chunk, std::nullopt, c.pad);
  EXPECT_NEAR(lng.item<double>(), ld.item<double>(), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedLmLoss,
                         ::testing::Values(Case{true, 0, 0.0}, Case{true, 4, 0.5}, Case{false, 5, 0.3},
                                           Case{true, 1, 0.85}, Case{false, 1000, 0.0},
                                           // the GPU's padded vocabulary (101 -> 128, 101 -> 104)
                                           Case{true, 4, 0.3, 64}, Case{false, 0, 0.0, 8}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// loss.backward()'s seed of 1 returns the saved gradients themselves: a weight also used
// elsewhere (tied, as GPT-2's embedding) gets the sum; a kept graph backs up twice (the saved
// gradients are not consumed), and once the graph is freed a third backward is torch's error.
TEST(FusedLmLoss, UnitSeedTiedWeightAndAKeptGraph) {
  torch::manual_seed(5);
  const int64_t n = 12, hsz = 8, v = 37;
  auto h0 = torch::randn({n, hsz}, torch::kDouble), w0 = torch::randn({v, hsz}, torch::kDouble) * 0.5;
  auto labels = torch::randint(0, v, {n}, torch::kLong);
  auto ids = torch::randint(0, v, {5}, torch::kLong);
  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto loss = fused_linear_cross_entropy(h, w, at::Tensor(), labels, -100, 5) + w.index_select(0, ids).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  const auto hg = h.grad().clone(), wg = w.grad().clone();
  auto hd = h0.clone().requires_grad_(true), wd = w0.clone().requires_grad_(true);
  (F::cross_entropy(F::linear(hd, wd), labels) + wd.index_select(0, ids).pow(2).sum()).backward();
  EXPECT_TRUE(torch::allclose(hg, hd.grad(), 1e-10, 1e-12));
  EXPECT_TRUE(torch::allclose(wg, wd.grad(), 1e-10, 1e-12));
  loss.backward();  // the kept graph: the same gradients again, accumulated
  EXPECT_TRUE(torch::allclose(h.grad(), 2 * hg, 1e-12, 1e-14));
  EXPECT_TRUE(torch::allclose(w.grad(), 2 * wg, 1e-12, 1e-14));
  EXPECT_THROW(loss.backward(), c10::Error);
}

// The bf16 path (matmuls in bf16, log-softmax and accumulators in fp32) on the CPU: against the
// float64 dense reference to bf16 rounding. Both CPU forms: oneDNN's bf16 GEMM API for the
// backward products where it runs (AVX512-BF16 without AMX), and ATen's bf16 matmul with the
// vocabulary padded inside (the blas engine; the only form on other CPUs).
class FusedLmLossBf16 : public ::testing::TestWithParam<cpu_gemm::Engine> {};

TEST_P(FusedLmLossBf16, MatmulsMatchTheReferenceToBf16Rounding) {
  const auto engine_before = cpu_gemm::set_engine(GetParam());
  struct Restore {
    cpu_gemm::Engine e;
    ~Restore() { cpu_gemm::set_engine(e); }
  } restore{engine_before};
  torch::manual_seed(4);
  const int64_t n = 40, hsz = 32, v = 300;
  auto h0 = torch::randn({n, hsz}, torch::kDouble), w0 = torch::randn({v, hsz}, torch::kDouble) * 0.3;
  auto b0 = torch::randn({v}, torch::kDouble) * 0.1;
  auto labels = torch::randint(0, v, {n}, torch::kLong);
  labels.masked_fill_(torch::rand({n}) < 0.3, -100);
  bool with_bias = true;
  auto run = [&](bool fused, int64_t pad = 0) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true), bb = b0.clone().requires_grad_(true);
    at::Tensor loss;
    if (fused) {
      loss = fused_linear_cross_entropy(h.to(torch::kFloat), w.to(torch::kFloat),
                                        with_bias ? bb.to(torch::kFloat) : at::Tensor(), labels, -100, 16,
                                        torch::kBFloat16, pad);
    } else {
      loss = F::cross_entropy(F::linear(h, w, with_bias ? bb : at::Tensor()), labels,
                              F::CrossEntropyFuncOptions().ignore_index(-100));
    }
    loss.backward();
    return std::make_tuple(loss.detach().to(torch::kDouble), h.grad(), w.grad(),
                           with_bias ? bb.grad() : torch::zeros({1}, torch::kDouble));
  };
  auto [lf, hf, wf, bf] = run(true);
  auto [ld, hd, wd, bd] = run(false);
  EXPECT_NEAR(lf.item<double>(), ld.item<double>(), 1e-2 * std::abs(ld.item<double>()));
  for (auto [got, want] : {std::make_pair(hf, hd), std::make_pair(wf, wd), std::make_pair(bf, bd)})
    EXPECT_LT((got - want).norm().item<double>() / want.norm().item<double>(), 2e-2);
  // Padded to 320 (the GPU's layout): the same loss and gradients as unpadded, to fp32 rounding.
  auto [lp, hp, wp, bp] = run(true, 64);
  EXPECT_NEAR(lp.item<double>(), lf.item<double>(), 1e-6 * std::abs(lf.item<double>()));
  EXPECT_EQ(wp.sizes(), wf.sizes());
  EXPECT_EQ(bp.sizes(), bf.sizes());
  for (auto [got, want] : {std::make_pair(hp, hf), std::make_pair(wp, wf), std::make_pair(bp, bf)})
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-7));
  // No bias (GPT-2's head): the CPU pads its bf16 vocabulary inside (300 -> 320) and gives the
  // padded logits -inf itself.
  with_bias = false;
  auto [lf0, hf0, wf0, bf0] = run(true);
  auto [ld0, hd0, wd0, bd0] = run(false);
  EXPECT_NEAR(lf0.item<double>(), ld0.item<double>(), 1e-2 * std::abs(ld0.item<double>()));
  for (auto [got, want] : {std::make_pair(hf0, hd0), std::make_pair(wf0, wd0)})
    EXPECT_LT((got - want).norm().item<double>() / want.norm().item<double>(), 2e-2);
}

INSTANTIATE_TEST_SUITE_P(Engines, FusedLmLossBf16, ::testing::Values(cpu_gemm::Engine::kOneDnn, cpu_gemm::Engine::kBlas),
                         [](const auto& info) { return info.param == cpu_gemm::Engine::kOneDnn ? "onednn" : "blas"; });

// An embedding tied to the fused LM head (GPT-2's wte): the head's backward gives the dense
// [V, H] gradient and the lookup's rows are added into it as a sparse gradient. Against the
// same weight used through torch::embedding and linear + cross_entropy: the same gradients, a
// dense .grad, the sparse path taken exactly when the head's gradient is in the same backward
// (not for a head-less loss, nor for a lookup another forward's head did not come from),
// padding_idx's row left out, a repeated id summed, and two accumulated backwards summed.
TEST(FusedLmLoss, TiedEmbeddingGradientIsSparseOnlyBesideTheHeadsDense) {
  torch::manual_seed(6);
  const int64_t b = 3, t = 7, hsz = 8, v = 41, pad = 5;
  auto w0 = torch::randn({v, hsz}, torch::kDouble) * 0.5;
  auto ids = torch::randint(0, v, {b, t}, torch::kLong);
  ids[0][0] = pad, ids[1][2] = pad, ids[2][2] = ids[2][3];  // a padded id and a repeated one
  auto labels = torch::randint(0, v, {b, t}, torch::kLong);
  auto mix = torch::randn({hsz, hsz}, torch::kDouble);
  // The model: looked-up rows through a tanh layer into the head; `head` off: a loss without it.
  auto loss_of = [&](const at::Tensor& w, bool ours, bool head) {
    auto x = ours ? tied_embedding::lookup(w, ids, pad) : torch::embedding(w, ids, pad);
    auto hdn = torch::tanh(x.matmul(mix));
    if (!head) return hdn.pow(2).sum();
    if (ours) return fused_linear_cross_entropy(hdn, w, at::Tensor(), labels);
    return F::cross_entropy(F::linear(hdn, w).reshape({-1, v}), labels.reshape({-1}));
  };
  for (bool head : {true, false}) {
    SCOPED_TRACE(head ? "with the head" : "head-less");
    auto wr = w0.clone().requires_grad_(true), wo = w0.clone().requires_grad_(true);
    loss_of(wr, false, head).backward();
    const int64_t before = tied_embedding::sparse_gradients();
    loss_of(wo, true, head).backward();
    EXPECT_EQ(tied_embedding::sparse_gradients() - before, head ? 1 : 0);
    ASSERT_TRUE(wo.grad().defined());
    EXPECT_EQ(wo.grad().layout(), torch::kStrided);
    EXPECT_TRUE(torch::allclose(wo.grad(), wr.grad(), 1e-10, 1e-12));
    // Accumulation: a second backward adds to the dense .grad.
    loss_of(wr, false, head).backward();
    loss_of(wo, true, head).backward();
    EXPECT_EQ(wo.grad().layout(), torch::kStrided);
    EXPECT_TRUE(torch::allclose(wo.grad(), wr.grad(), 1e-10, 1e-12));
  }
  // Two forwards, then their backwards, the head-less one last: each head marks only the
  // lookups its own hidden states came from, so the second lookup backs up dense.
  auto wr = w0.clone().requires_grad_(true), wo = w0.clone().requires_grad_(true);
  auto ra = loss_of(wr, false, true), rb = loss_of(wr, false, false);
  auto xa = tied_embedding::lookup(wo, ids, pad);
  auto xb = tied_embedding::lookup(wo, ids, pad);
  auto oa = fused_linear_cross_entropy(torch::tanh(xa.matmul(mix)), wo, at::Tensor(), labels);
  auto ob = torch::tanh(xb.matmul(mix)).pow(2).sum();
  int64_t before = tied_embedding::sparse_gradients();
  oa.backward();
  wo.mutable_grad() = at::Tensor();  // the head-less backward starts from no .grad
  ob.backward();
  EXPECT_EQ(tied_embedding::sparse_gradients() - before, 1);
  EXPECT_EQ(wo.grad().layout(), torch::kStrided);
  rb.backward();
  EXPECT_TRUE(torch::allclose(wo.grad(), wr.grad(), 1e-10, 1e-12));
  // Two lookups of the weight under one head (T5's encoder and decoder): both sparse.
  wr = w0.clone().requires_grad_(true), wo = w0.clone().requires_grad_(true);
  auto two = [&](const at::Tensor& w, bool ours) {
    auto look = [&] { return ours ? tied_embedding::lookup(w, ids, pad) : torch::embedding(w, ids, pad); };
    auto hdn = torch::tanh(look().matmul(mix)) * torch::sigmoid(look());
    if (ours) return fused_linear_cross_entropy(hdn, w, at::Tensor(), labels);
    return F::cross_entropy(F::linear(hdn, w).reshape({-1, v}), labels.reshape({-1}));
  };
  two(wr, false).backward();
  before = tied_embedding::sparse_gradients();
  two(wo, true).backward();
  EXPECT_EQ(tied_embedding::sparse_gradients() - before, 2);
  EXPECT_EQ(wo.grad().layout(), torch::kStrided);
  EXPECT_TRUE(torch::allclose(wo.grad().to_dense(), wr.grad(), 1e-10, 1e-12));
}

TEST(FusedLmLoss, NoLabelledRowsIsNaNLikeTorch) {
  auto h = torch::randn({4, 8}).requires_grad_(true);
  auto w = torch::randn({10, 8}).requires_grad_(true);
  auto labels = torch::full({4}, -100, torch::kLong);
  auto loss = fused_linear_cross_entropy(h, w, {}, labels);
  EXPECT_TRUE(std::isnan(loss.item<float>()));
}

TEST(FusedLmLoss, BertHeadPathsAgree) {
  ModelConfig mc;
  mc.vocab_size = 300, mc.hidden_size = 32, mc.num_hidden_layers = 2, mc.num_attention_heads = 2;
  mc.intermediate_size = 64, mc.hidden_dropout_prob = 0, mc.attention_probs_dropout_prob = 0;
  torch::manual_seed(0);
  BertForMaskedLM model(mc);
  auto ids = torch::randint(5, 300, {2, 12}, torch::kLong);
  auto labels = torch::where(torch::rand({2, 12}) < 0.3, ids, torch::full_like(ids, -100));
  labels[0][1] = ids[0][1];
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  std::vector<std::pair<double, at::Tensor>> results;
  for (auto [fused, sparse] : {std::pair{false, false}, {true, false}, {true, true}, {false, true}}) {
    model->fused_lm_loss_ = fused, model->score_masked_only_ = sparse;
    model->zero_grad();
    auto out = model->forward(ids, am, tt, labels);
    EXPECT_EQ(out.logits.defined(), !fused);
    out.loss.backward();
    results.emplace_back(out.loss.item<double>(),
                         model->encoder_model->embeddings->word_embeddings->weight.grad().clone());
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_NEAR(results[i].first, results[0].first, 1e-5) << i;
    EXPECT_TRUE(torch::allclose(results[i].second, results[0].second, 1e-4, 1e-6)) << i;
  }
}

}  // namespace
