// cpu_dropout: the keep mask is the documented counter-based stream (element by element against
// SplitMix64), kept elements are scaled by 1 / (1 - p) exactly as a float product, the keep rate
// is 1 - p, the result does not depend on the thread count, the gradient is the same mask, and
// the seed comes from the generator (manual_seed repeats it, a region's generator is its own).
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>

#include "polytrain/models/cpu_dropout.h"
#include "polytrain/models/tp_layers.h"

namespace polytrain {
namespace {

// Whether element i of a call with this seed and p is kept, from the documented formula.
bool kept(uint64_t seed, int64_t i, double p) {
  const int64_t b = i / 16, k = i % 16;
  const uint64_t w = dropout_mask_word(seed, static_cast<uint64_t>(8 * b + k % 8));
  const auto bits = static_cast<uint32_t>(k >= 8 ? w >> 32 : w);
  return bits < static_cast<uint32_t>(std::floor((1.0 - p) * 4294967296.0));
}

TEST(CpuDropout, MaskIsTheCounterStreamAndKeptValuesAreScaled) {
  const double p = 0.3;
  const int64_t n = 100003;  // not a multiple of 16: a partial last block
  auto x = torch::randn({n});
  torch::manual_seed(5);
  const uint64_t seed = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator())->random64();
  torch::manual_seed(5);
  auto y = cpu_dropout(x, p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  auto xa = x.accessor<float, 1>();
  auto ya = y.accessor<float, 1>();
  int64_t mismatches = 0, kept_count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool k = kept(seed, i, p);
    kept_count += k;
    const float expect = k ? xa[i] * scale : 0.0f;
    mismatches += ya[i] != expect;
  }
  EXPECT_EQ(mismatches, 0);
  // Binomial(n, 0.7): sd = sqrt(n * 0.21) = 145; 5 sd.
  EXPECT_NEAR(static_cast<double>(kept_count), 0.7 * n, 725.0);
}

TEST(CpuDropout, KeepRateAcrossProbabilitiesAndDtypes) {
  for (double p : {0.1, 0.5, 0.9}) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
      torch::manual_seed(1);
      const int64_t n = 1 << 20;
      auto y = cpu_dropout(torch::ones({n}, dtype), p);
      const double rate = y.ne(0).sum().item<double>() / n;
      const double sd = std::sqrt(p * (1 - p) / n);
      EXPECT_NEAR(rate, 1 - p, 5 * sd) << "p " << p << " dtype " << dtype;
      // Every kept value is 1 / (1 - p) rounded to the dtype.
      auto kept_values = y.masked_select(y.ne(0)).to(torch::kDouble);
      const double expect = static_cast<double>(torch::scalar_tensor(1.0 / (1.0 - p), dtype).item<double>());
      EXPECT_EQ(kept_values.min().item<double>(), expect);
      EXPECT_EQ(kept_values.max().item<double>(), expect);
    }
  }
  auto x = torch::randn({7, 9});
  EXPECT_TRUE(torch::equal(cpu_dropout(x, 0.0), x));
  EXPECT_EQ(cpu_dropout(x, 1.0).abs().sum().item<double>(), 0.0);
}

TEST(CpuDropout, SameResultOnOneThreadAndOnAll) {
  const int before = at::get_num_threads();
  auto x = torch::randn({3, 200003});
  auto with_threads = [&](int t) {
    at::set_num_threads(t);
    torch::manual_seed(9);
    return cpu_dropout(x, 0.1);
  };
  auto one = with_threads(1);
  auto many = with_threads(std::max(2, before));
  at::set_num_threads(before);
  EXPECT_TRUE(torch::equal(one, many));
}

TEST(CpuDropout, GradientIsTheSameMaskAndNonContiguousInputWorks) {
  torch::manual_seed(3);
  auto base = torch::randn({64, 33});
  auto x = base.t().requires_grad_(true);  // non-contiguous leaf view
  ASSERT_FALSE(x.is_contiguous());
  torch::manual_seed(4);
  auto y = cpu_dropout(x, 0.25);
  auto g = torch::randn_like(y);
  y.backward(g);
  // d(y)/d(x) is mask / (1 - p): the gradient is g where y kept x, scaled the same way.
  torch::manual_seed(4);
  auto expect = cpu_dropout(g.detach(), 0.25);
  EXPECT_TRUE(torch::equal(x.grad(), expect));
  EXPECT_TRUE(torch::equal(y.detach().ne(0), expect.ne(0).logical_and(x.detach().ne(0))));
}

TEST(CpuDropout, SeedComesFromTheGeneratorAndTheModuleUsesIt) {
  auto x = torch::ones({4096});
  torch::manual_seed(2);
  auto a = cpu_dropout(x, 0.5);
  auto b = cpu_dropout(x, 0.5);  // the default generator moved on
  torch::manual_seed(2);
  auto a2 = cpu_dropout(x, 0.5);
  EXPECT_TRUE(torch::equal(a, a2));
  EXPECT_FALSE(torch::equal(a, b));
  // A region's own generator: its masks do not depend on (or move) the default generator.
  Dropout d(0.5);
  d->generator = at::detail::createCPUGenerator(77);
  torch::manual_seed(2);
  auto r1 = d(x);
  auto after = torch::rand({1});
  d->generator = at::detail::createCPUGenerator(77);
  torch::manual_seed(123);
  auto r2 = d(x);
  EXPECT_TRUE(torch::equal(r1, r2));
  torch::manual_seed(2);
  EXPECT_TRUE(torch::equal(after, torch::rand({1})));
  d->eval();
  EXPECT_TRUE(torch::equal(d(x), x));
}

}  // namespace
}  // namespace polytrain
