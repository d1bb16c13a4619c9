// polytrain's own CUDA kernels (ops/cuda_ops.h) against the unfused ATen operations they
// replace: the cross-entropy chain of the LM loss (fp32, bf16, fp16; vector and scalar rows;
// -inf padding), add + LayerNorm and RMSNorm forward and backward, the padded fused LM loss on
// the GPU, and GPT-2 and T5 with the kernels against themselves without them. All need a GPU and this build's
// kernels: they skip on a CPU-only machine.
#include <functional>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/t5.h"
#include "polytrain/ops/cuda_ops.h"

using namespace polytrain;
namespace F = torch::nn::functional;

namespace {

#define NEED_KERNELS()                                                                   \
  do {                                                                                   \
    if (!torch::cuda::is_available() || !cuda_ops::built())                              \
      GTEST_SKIP() << "needs a GPU and a build with polytrain's CUDA kernels";           \
    cuda_ops::set_enabled(true);                                                         \
  } while (0)

// |got - want| <= atol + rtol |want| everywhere; prints the worst element otherwise.
void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol, const char* what) {
  auto g = got.to(torch::kDouble).cpu(), w = want.to(torch::kDouble).cpu();
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  auto excess = (g - w).abs() - (atol + rtol * w.abs());
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>() << " at max |want| " << w.abs().max().item<double>();
}

// The loss and every parameter's gradient of one bf16-autocast step of `loss_of`, with the
// kernels and without them (the unfused ATen paths); compared to bf16 tolerances.
void expect_same_step_with_and_without_kernels(torch::nn::Module& model, const std::function<at::Tensor()>& loss_of) {
  auto run = [&](bool kernels) {
    cuda_ops::set_enabled(kernels);
    model.zero_grad();
    at::Tensor loss;
    {
      AutocastGuard ac(c10::DeviceType::CUDA, torch::kBFloat16);
      loss = loss_of();
    }
    loss.backward();
    std::vector<at::Tensor> out{loss.detach()};
    for (auto& p : model.parameters()) out.push_back(p.grad().clone());
    cuda_ops::set_enabled(true);
    return out;
  };
  auto f = run(true), u = run(false);
  EXPECT_NEAR(f[0].item<double>(), u[0].item<double>(), 2e-3 * std::abs(u[0].item<double>()));
  for (size_t i = 1; i < f.size(); ++i)
    EXPECT_LT((f[i] - u[i]).norm().item<double>() / (u[i].norm().item<double>() + 1e-12), 3e-2) << "parameter " << i - 1;
}

struct XentCase {
  at::ScalarType dtype;
  int64_t cols;
  int64_t padded;  ///< trailing -inf columns
};

class CudaXent : public ::testing::TestWithParam<XentCase> {};

TEST_P(CudaXent, MatchesTheAtenChain) {
  NEED_KERNELS();
  const auto c = GetParam();
  torch::manual_seed(7);
  const int64_t rows = 37;
  auto logits = (torch::randn({rows, c.cols}) * 3).to(torch::kCUDA);
  if (c.padded > 0) logits.narrow(1, c.cols - c.padded, c.padded).fill_(-std::numeric_limits<float>::infinity());
  logits = logits.to(c.dtype);
  auto labels = torch::randint(0, c.cols - c.padded, {rows}, torch::kLong).to(torch::kCUDA);
  auto weight = torch::rand({rows}).to(torch::kCUDA);
  weight[3] = 0.0;  // an ignored row
  // Reference: ATen's chain in fp32 from the same (rounded) logits.
  auto x = logits.to(torch::kFloat);
  auto logp = torch::log_softmax(x, 1);
  auto want_loss = -(logp.gather(1, labels.unsqueeze(1)).squeeze(1) * weight);
  auto want_grad = (logp.exp() - F::one_hot(labels, c.cols).to(torch::kFloat)) * weight.unsqueeze(1);
  auto g = logits.clone();
  auto loss = cuda_ops::xent_grad_(g, labels, weight);
  expect_close(loss, want_loss, 1e-5, 1e-5, "row losses");
  // The gradient is rounded once to the logits' dtype: one unit in its last place.
  const double rtol = c.dtype == torch::kFloat ? 1e-5 : c.dtype == torch::kBFloat16 ? 8e-3 : 1e-3;
  expect_close(g, want_grad, rtol, 1e-6, "gradient");
  if (c.padded > 0) EXPECT_EQ(g.narrow(1, c.cols - c.padded, c.padded).abs().max().item<double>(), 0.0);
  EXPECT_EQ(g[3].abs().max().item<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaXent,
                         ::testing::Values(XentCase{torch::kFloat, 1000, 0}, XentCase{torch::kBFloat16, 50304, 47},
                                           XentCase{torch::kHalf, 1001, 0}, XentCase{torch::kBFloat16, 999, 0},
                                           XentCase{torch::kFloat, 30528, 6}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

TEST(CudaOps, AddLayerNormMatchesAddThenLayerNormForwardAndBackward) {
  NEED_KERNELS();
  torch::manual_seed(8);
  for (auto out_dtype : {torch::kFloat, torch::kBFloat16}) {
    const int64_t b = 3, t = 5, d = 768;
    auto x0 = torch::randn({b, t, d}, torch::kCUDA), y0 = torch::randn({b, t, d}, torch::kCUDA).to(torch::kBFloat16);
    auto g0 = 1 + 0.1 * torch::randn({d}, torch::kCUDA), be0 = 0.1 * torch::randn({d}, torch::kCUDA);
    auto r1 = torch::randn({b, t, d}, torch::kCUDA), r2 = torch::randn({b, t, d}, torch::kCUDA);
    auto run = [&](bool fused) {
      auto x = x0.clone().requires_grad_(true), y = y0.clone().requires_grad_(true);
      auto g = g0.clone().requires_grad_(true), be = be0.clone().requires_grad_(true);
      at::Tensor h, out;
      if (fused) {
        std::tie(h, out) = cuda_ops::add_layer_norm(x, y, g, be, 1e-5, out_dtype);
      } else {
        h = x + y;
        out = F::layer_norm(h, F::LayerNormFuncOptions({d}).weight(g).bias(be).eps(1e-5)).to(out_dtype);
      }
      EXPECT_EQ(out.scalar_type(), out_dtype);
      EXPECT_EQ(h.scalar_type(), torch::kFloat);
      ((out.to(torch::kFloat) * r1).sum() + (h * r2).sum()).backward();
      return std::vector<at::Tensor>{h.detach(), out.detach(), x.grad(), y.grad(), g.grad(), be.grad()};
    };
    auto f = run(true), u = run(false);
    const double rt = out_dtype == torch::kFloat ? 1e-5 : 8e-3;
    expect_close(f[0], u[0], 0, 0, "h");
    expect_close(f[1], u[1], rt, 1e-5, "normalised");
    const char* names[] = {"", "", "dx", "dy", "dgamma", "dbeta"};
    for (int i = 2; i < 6; ++i) expect_close(f[i], u[i], i == 3 ? 8e-3 : 1e-4, 1e-4, names[i]);
  }
}

TEST(CudaOps, RmsNormMatchesT5sFormulaForwardAndBackward) {
  NEED_KERNELS();
  torch::manual_seed(11);
  for (auto out_dtype : {torch::kFloat, torch::kBFloat16}) {
    const int64_t d = 512;
    auto x0 = torch::randn({4, 9, d}, torch::kCUDA), w0 = 1 + 0.1 * torch::randn({d}, torch::kCUDA);
    auto r = torch::randn({4, 9, d}, torch::kCUDA);
    auto run = [&](bool fused) {
      auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      at::Tensor out;
      if (fused) {
        out = cuda_ops::rms_norm(x, w, 1e-6, out_dtype);
      } else {
        out = (w * (x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-6))).to(out_dtype);
      }
      EXPECT_EQ(out.scalar_type(), out_dtype);
      (out.to(torch::kFloat) * r).sum().backward();
      return std::vector<at::Tensor>{out.detach(), x.grad(), w.grad()};
    };
    auto f = run(true), u = run(false);
    expect_close(f[0], u[0], out_dtype == torch::kFloat ? 1e-5 : 8e-3, 1e-5, "normalised");
    expect_close(f[1], u[1], 1e-4, 1e-4, "dx");
    expect_close(f[2], u[2], 1e-4, 1e-3, "dweight");
  }
}

TEST(CudaOps, T5WithTheKernelsMatchesT5WithoutThem) {
  NEED_KERNELS();
  T5Config c;
  c.d_model = 64, c.d_kv = 16, c.d_ff = 128, c.num_layers = 2, c.num_heads = 4, c.vocab_size = 1000;
  c.dropout_rate = 0.0;
  torch::manual_seed(12);
  T5ForConditionalGeneration model(c);
  model->to(torch::kCUDA);
  auto src = torch::randint(2, c.vocab_size, {3, 24}, torch::kLong).to(torch::kCUDA);
  auto tgt = torch::randint(2, c.vocab_size, {3, 8}, torch::kLong).to(torch::kCUDA);
  expect_same_step_with_and_without_kernels(*model, [&] { return model->forward(src, {}, tgt).loss; });
}

TEST(CudaOps, PaddedFusedLmLossWithTheKernelMatchesTheDenseLoss) {
  NEED_KERNELS();
  torch::manual_seed(9);
  const int64_t n = 300, hsz = 64, v = 50257;
  auto h0 = torch::randn({n, hsz}, torch::kCUDA), w0 = 0.05 * torch::randn({v, hsz}, torch::kCUDA);
  auto labels = torch::randint(0, v, {n}, torch::kLong).to(torch::kCUDA);
  labels.masked_fill_(torch::rand({n}, torch::kCUDA) < 0.2, -100);
  auto run = [&](bool fused) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor loss;
    {
      AutocastGuard ac(c10::DeviceType::CUDA, torch::kBFloat16);
      loss = fused ? fused_linear_cross_entropy(h, w, {}, labels, -100, 128)
                   : F::cross_entropy(F::linear(h.to(torch::kDouble), w.to(torch::kDouble)), labels,
                                      F::CrossEntropyFuncOptions().ignore_index(-100));
    }
    loss.backward();
    return std::vector<at::Tensor>{loss.detach().to(torch::kDouble), h.grad(), w.grad()};
  };
  auto f = run(true), d = run(false);
  EXPECT_NEAR(f[0].item<double>(), d[0].item<double>(), 1e-2 * std::abs(d[0].item<double>()));
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(f[i].sizes(), d[i].sizes());
    EXPECT_LT((f[i].to(torch::kDouble) - d[i]).norm().item<double>() / d[i].norm().item<double>(), 2e-2);
  }
}

TEST(CudaOps, Gpt2WithTheKernelsMatchesGpt2WithoutThem) {
  NEED_KERNELS();
  Gpt2Config c;
  c.n_embd = 128, c.n_layer = 3, c.n_head = 4, c.vocab_size = 1001, c.n_positions = 64;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
  c.attn_implementation = "sdpa";
  torch::manual_seed(10);
  Gpt2LMHeadModel model(c);
  model->to(torch::kCUDA);
  auto ids = torch::randint(0, c.vocab_size, {4, 64}, torch::kLong).to(torch::kCUDA);
  expect_same_step_with_and_without_kernels(*model, [&] { return model->forward(ids, {}, ids).loss; });
}

}  // namespace
