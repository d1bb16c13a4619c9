// fp16 loss scaling: DeepSpeed's DynamicLossScaler trajectory worked out by hand from its
// update_scale (hysteresis, window counted from the last overflow, consecutive_hysteresis,
// the error at min_loss_scale), static scaling, state round trip; and the backends' unscale.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/parallel/update.h"
#include "polytrain/optim/loss_scaler.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {
namespace {

Fp16Config dyn(int power, int64_t window, int hysteresis, bool consecutive = false, double min_scale = 1.0) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 0.0;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.consecutive_hysteresis = consecutive;
  c.min_loss_scale = min_scale;
  return c;
}

struct Expect {
  bool overflow;
  double scale;  // after the update
  int hysteresis;
};

void follow(LossScaler& s, const std::vector<Expect>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string what = s.update(steps[i].overflow);
    EXPECT_EQ(s.scale(), steps[i].scale) << "iteration " << i;
    EXPECT_EQ(s.hysteresis_left(), steps[i].hysteresis) << "iteration " << i;
    EXPECT_EQ(what.empty(), !steps[i].overflow) << "iteration " << i << ": " << what;
  }
}

TEST(LossScaler, DynamicWithHysteresis) {
  LossScaler s(dyn(4, 3, 2));
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 16.0);
  follow(s, {
                {false, 16, 2},  // iter 0: (0 - -1) % 3 = 1
                {false, 16, 2},  // iter 1: 2
                {false, 32, 2},  // iter 2: 3 % 3 = 0 -> x2
                {true, 32, 1},   // iter 3: first overflow uses up the hysteresis, scale kept
                {true, 16, 1},   // iter 4: /2
                {false, 16, 1},  // iter 5: not consecutive: the hysteresis is not restored
                {true, 8, 1},    // iter 6: /2 at once
                {false, 8, 1},   // iter 7: (7 - 6) % 3 = 1
                {false, 8, 1},   // iter 8: 2
                {false, 16, 2},  // iter 9: 3 -> x2, hysteresis restored
            });
}

TEST(LossScaler, ConsecutiveHysteresisRestoresOnEveryGoodStep) {
  LossScaler s(dyn(4, 3, 2, /*consecutive=*/true));
  follow(s, {
                {true, 16, 1},   // iter 0
                {false, 16, 2},  // iter 1: restored at once
                {true, 16, 1},   // iter 2: absorbed again
                {true, 8, 1},    // iter 3
            });
}

TEST(LossScaler, NoHysteresisHalvesOnEveryOverflowDownToTheMinimumThenErrors) {
  LossScaler s(dyn(2, 1000, 1, false, /*min_scale=*/1.0));
  follow(s, {{true, 2, 1}, {true, 1, 1}});
  EXPECT_THROW(s.update(true), Error);
  // A minimum that is not a power of two is reached by clamping.
  LossScaler t(dyn(3, 1000, 1, false, 3.0));
  follow(t, {{true, 4, 1}, {true, 3, 1}});
  EXPECT_THROW(t.update(true), Error);
}

TEST(LossScaler, WindowOfOneDoublesEveryGoodStep) {
  LossScaler s(dyn(0, 1, 2));
  follow(s, {{false, 2, 2}, {false, 4, 2}, {true, 4, 1}, {false, 8, 2}});
}

TEST(LossScaler, StaticScaleNeverMoves) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 128;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  for (bool o : {false, true, true, false}) {
    const std::string what = s.update(o);
    EXPECT_EQ(s.scale(), 128.0);
    EXPECT_EQ(what.empty(), !o);
  }
}

TEST(LossScaler, StateRoundTripContinuesIdentically) {
  const std::vector<bool> flags = {false, true, false, false, true, true, false, false, false, false, true, false};
  LossScaler a(dyn(5, 2, 2)), b(dyn(5, 2, 2));
  for (size_t i = 0; i < 5; ++i) a.update(flags[i]);
  b.load_state(nlohmann::json::parse(a.state().dump()));
  for (size_t i = 5; i < flags.size(); ++i) {
    a.update(flags[i]);
    b.update(flags[i]);
    EXPECT_EQ(a.scale(), b.scale()) << i;
    EXPECT_EQ(a.hysteresis_left(), b.hysteresis_left()) << i;
  }
  EXPECT_THROW(b.load_state(nlohmann::json{{"cur_scale", "big"}}), InputError);
  EXPECT_THROW(b.load_state(nlohmann::json{{"cur_scale", -1.0}}), InputError);
}

// The update divides gradients by the loss scale before the norm, clipping and the step: with
// scaled gradients and the scale given, the same parameters as unscaled gradients (a power of
// two scale is exact); an overflowing gradient skips the update.
TEST(LossScaler, BackendsUnscaleBeforeNormClipAndStep) {
  torch::manual_seed(0);
  auto make = [] {
    auto p = torch::randn({5, 3}).requires_grad_(true);
    return p;
  };
  auto p1 = make(), p2 = p1.detach().clone().requires_grad_(true);
  const auto g = torch::randn({5, 3});
  p1.mutable_grad() = g.clone();
  p2.mutable_grad() = g * 1024.0;
  OptimizerConfig sgd;
  sgd.type = "SGD";
  sgd.lr = 0.1;
  auto o1 = make_optimizer(sgd, {ParamGroup{{{"p", p1}}, 0.0}}), o2 = make_optimizer(sgd, {ParamGroup{{{"p", p2}}, 0.0}});
  auto opts = [](double loss_scale) {
    UpdateOptions o;
    o.lr = 0.1, o.clip = 0.5, o.grad_scale = 1.0 / loss_scale;
    return o;
  };
  const auto r1 = apply_update({p1}, *o1, opts(1.0));
  const auto r2 = apply_update({p2}, *o2, opts(1024.0));
  EXPECT_TRUE(r1.applied && r2.applied);
  EXPECT_EQ(r1.grad_norm, r2.grad_norm);
  EXPECT_TRUE(torch::equal(p1, p2));
  p2.mutable_grad() = torch::full({5, 3}, std::numeric_limits<float>::infinity());
  const auto before = p2.detach().clone();
  EXPECT_FALSE(apply_update({p2}, *o2, opts(1024.0)).applied);
  EXPECT_TRUE(torch::equal(p2, before));
}

// The guard really switches autocast on for the device (matmuls run in the low type), nests,
// and restores the previous state.
TEST(Autocast, Bf16OnCpuNestsAndRestores) {
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    {
      AutocastGuard inner(c10::kCPU, at::kBFloat16);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  EXPECT_THROW(AutocastGuard(c10::kCPU, at::kHalf), InputError);
}

TEST(Autocast, Fp16AndBf16OnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA (no GPU visible)";
  const auto a = torch::randn({4, 4}, torch::kCUDA), b = torch::randn({4, 4}, torch::kCUDA);
  for (auto t : {at::kHalf, at::kBFloat16}) {
    AutocastGuard g(c10::kCUDA, t);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), t);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace polytrain
