// polytrain's CPU kernels (ops/cpu_ops.h) against ATen's: GELU's tanh form forward and backward,
// the cross-entropy chain, and the fused LM loss through them, in fp32 and bf16; the causal
// attention against the eager math in double, with and without dropout; the kernels' thread pool.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/models/cpu_dropout.h"
#include "polytrain/models/fused_lm_loss.h"
#include "polytrain/common/error.h"
#include "polytrain/ops/cpu_ops.h"
#include "polytrain/optim/worker_pool.h"

using namespace polytrain;

namespace {

struct KernelsOn {  // the tests compare against ATen with the kernels off, whatever the environment
  KernelsOn() { cpu_ops::set_enabled(true); }
  ~KernelsOn() { cpu_ops::set_enabled(true); }
};

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Values over GELU's whole range, 16 * 64 + 7 of them (a tail of 7 behind whole vectors).
at::Tensor gelu_inputs() {
  torch::manual_seed(3);
  auto x = torch::randn({1031}) * 4;
  x.narrow(0, 0, 5).copy_(torch::tensor({0.0f, -0.0f, 30.0f, -30.0f, 1e-20f}));
  return x;
}

}  // namespace

TEST(CpuOps, GeluMatchesAtenInFp32ForwardAndBackward) {
  KernelsOn on;
  auto x = gelu_inputs().requires_grad_(true);
  auto xr = x.detach().to(at::kDouble).requires_grad_(true);
  auto y = cpu_ops::gelu_tanh(x);
  auto yr = torch::gelu(xr, "tanh");
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_LT(max_abs(y, yr), 1e-6);
  auto g = torch::randn({x.size(0)});
  y.backward(g);
  yr.backward(g.to(at::kDouble));
  EXPECT_LT(max_abs(x.grad(), xr.grad()), 1e-6);
}

TEST(CpuOps, GeluInBf16IsTheFp32ResultRoundedOnce) {
  KernelsOn on;
  auto x = gelu_inputs().to(at::kBFloat16).requires_grad_(true);
  auto y = cpu_ops::gelu_tanh(x);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  auto ref = cpu_ops::gelu_tanh(x.detach().to(at::kFloat)).to(at::kBFloat16);
  EXPECT_TRUE(torch::equal(y.detach(), ref));
  auto aten = torch::gelu(x.detach().to(at::kDouble), "tanh");
  // one bf16 rounding (2^-8 relative) of an fp32 result (1e-6 absolute)
  EXPECT_LE(((y.detach().to(at::kDouble) - aten).abs() - aten.abs() / 256 - 1e-6).max().item<double>(), 0.0);
  y.backward(torch::ones_like(y));
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
}

TEST(CpuOps, GeluOfAnElementDoesNotDependOnItsPlaceOrTheThreads) {
  KernelsOn on;
  torch::manual_seed(21);
  auto x = torch::randn({100003}) * 3;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto one = cpu_ops::gelu_tanh(x);
  at::set_num_threads(2);
  auto two = cpu_ops::gelu_tanh(x);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, two));
  // shifted by one: every element moves between vector lanes, the tail and the body
  EXPECT_TRUE(torch::equal(cpu_ops::gelu_tanh(x.narrow(0, 1, x.size(0) - 1).contiguous()), one.narrow(0, 1, x.size(0) - 1)));
  // Each of 4096 elements alone (all tail) against the same element in the body, forward and
  // backward (the tail once ran the generic build, without FMA: 197 values and 407 gradients of
  // these 4096 differed).
  const auto g = torch::randn({100003});
  auto xr = x.clone().requires_grad_();
  cpu_ops::gelu_tanh(xr).backward(g);
  int differ = 0, differ_grad = 0;
  for (int64_t i = 0; i < 4096; ++i) {
    differ += !torch::equal(cpu_ops::gelu_tanh(x.narrow(0, i, 1).contiguous()), one.narrow(0, i, 1));
    auto xi = x.narrow(0, i, 1).clone().requires_grad_();
    cpu_ops::gelu_tanh(xi).backward(g.narrow(0, i, 1).contiguous());
    differ_grad += !torch::equal(xi.grad(), xr.grad().narrow(0, i, 1));
  }
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(differ_grad, 0);
}

TEST(CpuOps, Avx2AndAvx512GiveTheSameBits) {
  KernelsOn on;
  if (cpu_ops::set_vector_level(-1) < 2) GTEST_SKIP() << "needs AVX-512 to compare with";
  torch::manual_seed(9);
  auto x = torch::randn({4099}) * 5;
  auto g = torch::randn({4099});
  auto logits = torch::randn({6, 333}) * 4;
  auto y = torch::randint(0, 333, {6}, torch::kLong);
  auto w = torch::full({6}, 0.25f);
  auto qkv = torch::randn({2, 70, 3 * 2 * 16});
  auto ga = torch::randn({2, 70, 2 * 16});
  at::Tensor out[2][7];
  for (int level = 1; level <= 2; ++level) {
    EXPECT_EQ(cpu_ops::set_vector_level(level), level);
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      auto xg = x.to(dtype).clone().requires_grad_(true);
      auto yv = cpu_ops::gelu_tanh(xg);
      yv.backward(g.to(dtype));
      out[level - 1][dtype == at::kFloat ? 0 : 1] = torch::cat({yv.detach(), xg.grad()}).to(at::kFloat);
    }
    auto gl = logits.to(at::kBFloat16);
    auto gf = logits.clone();
    out[level - 1][2] = cpu_ops::xent_grad_(gl, y, w);
    out[level - 1][3] = gl;
    cpu_ops::xent_grad_(gf, y, w);
    out[level - 1][4] = gf;
    auto q = qkv.clone().requires_grad_(true);
    auto att = cpu_ops::causal_attention(q, 2, 0.3, 0.2, 99);
    att.backward(ga);
    out[level - 1][5] = att.detach();
    out[level - 1][6] = q.grad();
  }
  cpu_ops::set_vector_level(-1);
  for (int k = 0; k < 7; ++k) EXPECT_TRUE(torch::equal(out[0][k], out[1][k])) << k;
}

TEST(CpuOps, GeluPropagatesNan) {
  KernelsOn on;
  auto x = torch::tensor({1.0f, std::nanf(""), -2.0f});
  auto y = cpu_ops::gelu_tanh(x);
  EXPECT_TRUE(std::isnan(y[1].item<float>()));
  EXPECT_FALSE(std::isnan(y[0].item<float>()));
}

// The gradient norm's sum of squares: against float64 for sizes around the 16-lane vectors and
// the 4096-element blocks, fp32 and bf16, AVX-512 and AVX2 alike; a value whose fp32 square
// would overflow sums finite (squares in double); NaN and inf come through.
TEST(CpuOps, SumOfSquaresMatchesFloat64) {
  KernelsOn on;
  const int top = cpu_ops::set_vector_level(-1);
  for (int level : {0, 1, 2}) {
    if (level > top) continue;
    cpu_ops::set_vector_level(level);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{17}, int64_t{4095}, int64_t{4097}, int64_t{100003}}) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        const auto x = (torch::randn({n}) * 3).to(dtype);
        const double want = x.to(at::kDouble).pow(2).sum().item<double>();
        EXPECT_NEAR(cpu_ops::sum_of_squares(x), want, 1e-12 * want) << "level " << level << " n " << n;
      }
    }
  }
  cpu_ops::set_vector_level(-1);
  auto big = torch::ones({5000});
  big[4500] = 1e20f;
  EXPECT_NEAR(cpu_ops::sum_of_squares(big), 1e40 + 4999, 1e34);
  big[10] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(cpu_ops::sum_of_squares(big)));
  big[10] = std::nanf("");
  EXPECT_TRUE(std::isnan(cpu_ops::sum_of_squares(big)));
  EXPECT_THROW(cpu_ops::sum_of_squares(torch::ones({4, 4}).t().narrow(0, 0, 2)), InternalError);
}

namespace {

struct XentRef {
  at::Tensor loss, grad;
};

XentRef xent_reference(const at::Tensor& logits, const at::Tensor& y, const at::Tensor& w) {
  auto l = logits.to(at::kDouble);
  auto logp = torch::log_softmax(l, 1);
  auto wd = w.to(at::kDouble);
  auto loss = -logp.gather(1, y.unsqueeze(1)).squeeze(1) * wd;
  auto grad = logp.exp() - torch::one_hot(y, l.size(1)).to(at::kDouble);
  return {loss, grad * wd.unsqueeze(1)};
}

}  // namespace

TEST(CpuOps, CrossEntropyChainMatchesTheReferenceInFp32AndBf16) {
  KernelsOn on;
  torch::manual_seed(5);
  const int64_t rows = 9, cols = 1000 + 13;  // not a multiple of 16
  auto logits = torch::randn({rows, cols}) * 3;
  logits.narrow(1, cols - 13, 13).fill_(-std::numeric_limits<float>::infinity());  // a padded vocabulary
  auto y = torch::randint(0, cols - 13, {rows}, torch::kLong);
  auto w = torch::full({rows}, 1.0f / rows);
  w[4] = 0.0f;  // an ignored row
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    auto x = logits.to(dtype);
    auto ref = xent_reference(x, y, w);
    auto g = x.clone();
    auto loss = cpu_ops::xent_grad_(g, y, w);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
    EXPECT_LT(max_abs(loss, ref.loss), 1e-6) << dtype;
    const double tol = dtype == at::kFloat ? 1e-8 : 1.0 / rows / 256;
    EXPECT_LT(max_abs(g, ref.grad), tol) << dtype;
    EXPECT_TRUE(torch::all(g.narrow(1, cols - 13, 13) == 0).item<bool>());
    EXPECT_TRUE(torch::all(g[4] == 0).item<bool>());
    auto no_grad = x.clone();
    EXPECT_TRUE(torch::equal(cpu_ops::xent_grad_(no_grad, y, w, false), loss));
    EXPECT_TRUE(torch::equal(no_grad, x));  // untouched without grad
  }
}

TEST(CpuOps, CrossEntropyChainPropagatesNanAndRefusesABadLabel) {
  KernelsOn on;
  auto logits = torch::randn({2, 40});
  logits[1][7] = std::nanf("");
  auto loss = cpu_ops::xent_grad_(logits, torch::tensor({3, 3}, torch::kLong), torch::ones({2}));
  EXPECT_FALSE(std::isnan(loss[0].item<float>()));
  EXPECT_TRUE(std::isnan(loss[1].item<float>()));
  auto x = torch::randn({2, 40});
  EXPECT_ANY_THROW(cpu_ops::xent_grad_(x, torch::tensor({3, 40}, torch::kLong), torch::ones({2})));
}

TEST(CpuOps, FusedLmLossThroughTheKernelsEqualsTheAtenPath) {
  torch::manual_seed(11);
  const int64_t tokens = 70, hidden = 24, vocab = 301;
  auto h0 = torch::randn({2, tokens / 2, hidden});
  auto w0 = torch::randn({vocab, hidden}) * 0.2;
  auto labels = torch::randint(0, vocab, {2, tokens / 2}, torch::kLong);
  labels[0][3] = -100;
  for (const bool bf16 : {false, true}) {
    at::Tensor loss[2], gh[2], gw[2];
    for (int on = 0; on < 2; ++on) {
      cpu_ops::set_enabled(on == 1);
      auto h = h0.clone().requires_grad_(true);
      auto w = w0.clone().requires_grad_(true);
      {
        std::optional<AutocastGuard> autocast;
        if (bf16) autocast.emplace(c10::DeviceType::CPU, c10::kBFloat16);
        loss[on] = fused_linear_cross_entropy(h, w, at::Tensor(), labels, -100, /*chunk_rows=*/16);
      }
      loss[on].backward();
      gh[on] = h.grad(), gw[on] = w.grad();
    }
    cpu_ops::set_enabled(true);
    const double tol = bf16 ? 2e-2 : 1e-5;
    EXPECT_NEAR(loss[1].item<double>(), loss[0].item<double>(), tol * loss[0].abs().item<double>()) << bf16;
    EXPECT_LT(max_abs(gh[1], gh[0]), tol * gh[0].abs().max().item<double>()) << bf16;
    EXPECT_LT(max_abs(gw[1], gw[0]), tol * gw[0].abs().max().item<double>()) << bf16;
  }
}

namespace {

// The eager path's math on qkv [B, L, 3 H D]: scores, the causal mask, softmax, dropout (the
// multiplier tensor `keep`, or none), context [B, L, H D].
at::Tensor eager_attention(const at::Tensor& qkv, int64_t heads, double scale, const at::Tensor& keep) {
  const int64_t b = qkv.size(0), l = qkv.size(1);
  auto parts = qkv.split(qkv.size(2) / 3, 2);
  auto split = [&](const at::Tensor& t) { return t.view({b, l, heads, -1}).transpose(1, 2); };
  auto scores = torch::matmul(split(parts[0]), split(parts[1]).transpose(-1, -2)) * scale;
  auto future = torch::ones({l, l}, torch::kBool).triu(1);
  auto probs = torch::softmax(scores.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
  if (keep.defined()) probs = probs * keep.to(probs.scalar_type());
  return torch::matmul(probs, split(parts[2])).transpose(1, 2).reshape({b, l, -1});
}

struct AttnCase {
  int64_t b, l, h, d;
};

}  // namespace

TEST(CpuOps, CausalAttentionMatchesTheEagerMathForwardAndBackward) {
  KernelsOn on;
  // One tile and less, a partial last tile with a vector tail, four whole tiles, a single token.
  for (const AttnCase c : {AttnCase{2, 70, 2, 16}, AttnCase{1, 130, 3, 24}, AttnCase{2, 256, 2, 64}, AttnCase{1, 1, 2, 8},
                           AttnCase{3, 17, 1, 4}}) {
    torch::manual_seed(21);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d)) * 0.7;
    auto qkv = (torch::randn({c.b, c.l, 3 * c.h * c.d}) * 2).requires_grad_(true);
    auto g = torch::randn({c.b, c.l, c.h * c.d});
    auto out = cpu_ops::causal_attention(qkv, c.h, scale, 0.0, 0);
    out.backward(g);
    auto ref_in = qkv.detach().to(at::kDouble).requires_grad_(true);
    auto ref = eager_attention(ref_in, c.h, scale, at::Tensor());
    ref.backward(g.to(at::kDouble));
    const std::string what = std::to_string(c.b) + "x" + std::to_string(c.l) + " h" + std::to_string(c.h);
    EXPECT_LT(max_abs(out, ref), 2e-6 * ref.abs().max().item<double>()) << what;
    EXPECT_LT(max_abs(qkv.grad(), ref_in.grad()), 2e-5 * ref_in.grad().abs().max().item<double>()) << what;
    // A query's context does not see later keys or values: change the last token's k and v.
    auto moved = qkv.detach().clone();
    moved.select(1, c.l - 1).narrow(0, 0, 1).narrow(-1, c.h * c.d, 2 * c.h * c.d).add_(5.0);
    auto out2 = cpu_ops::causal_attention(moved, c.h, scale, 0.0, 0);
    EXPECT_TRUE(torch::equal(out2.narrow(1, 0, c.l - 1), out.detach().narrow(1, 0, c.l - 1))) << what;
  }
}

TEST(CpuOps, CausalAttentionDropsWhatCpuDropoutDropsForTheSameSeed) {
  KernelsOn on;
  const int64_t b = 2, l = 100, h = 3, d = 16;
  const double p = 0.3, scale = 0.25;
  torch::manual_seed(5);
  auto qkv = torch::randn({b, l, 3 * h * d}).requires_grad_(true);
  auto g = torch::randn({b, l, h * d});
  // cpu_dropout's multipliers on a [B, H, L, L] tensor of ones, from the seed the kernel draws.
  torch::manual_seed(77);
  auto keep = cpu_dropout(torch::ones({b, h, l, l}), p);
  torch::manual_seed(77);
  const uint64_t seed = dropout_seed(nullptr);
  auto out = cpu_ops::causal_attention(qkv, h, scale, p, seed);
  out.backward(g);
  auto ref_in = qkv.detach().to(at::kDouble).requires_grad_(true);
  auto ref = eager_attention(ref_in, h, scale, keep);
  ref.backward(g.to(at::kDouble));
  EXPECT_LT(max_abs(out, ref), 2e-6 * ref.abs().max().item<double>());
  EXPECT_LT(max_abs(qkv.grad(), ref_in.grad()), 2e-5 * ref_in.grad().abs().max().item<double>());
  // The mask is not all ones: without it the result differs.
  auto plain = eager_attention(qkv.detach().to(at::kDouble), h, scale, at::Tensor());
  EXPECT_GT(max_abs(plain, ref), 0.1);
}

TEST(CpuOps, CausalAttentionRefusesWhatItDoesNotTake) {
  KernelsOn on;
  EXPECT_FALSE(cpu_ops::causal_attention_handles(torch::randn({1, 4, 3 * 8}).to(at::kBFloat16), 2));
  EXPECT_FALSE(cpu_ops::causal_attention_handles(torch::randn({1, 4, 25}), 2));
  EXPECT_FALSE(cpu_ops::causal_attention_handles(torch::randn({4, 24}), 2));
  EXPECT_TRUE(cpu_ops::causal_attention_handles(torch::randn({1, 4, 24}), 2));
  EXPECT_THROW(cpu_ops::causal_attention(torch::randn({1, 4, 25}), 2, 1.0, 0.0, 0), std::exception);
  EXPECT_THROW(cpu_ops::causal_attention(torch::randn({1, 4, 24}), 2, 1.0, 1.0, 0), std::exception);
  cpu_ops::set_enabled(false);
  EXPECT_FALSE(cpu_ops::causal_attention_handles(torch::randn({1, 4, 24}), 2));
}

// ---- the kernels' thread pool (optim/worker_pool.h) ----------------------------------------------

namespace {

struct PoolProbe {
  std::vector<std::atomic<int>> hits;
  std::atomic<int> in_team{0}, calls{0};
  int (*in_parallel)() = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_in_parallel"));
  int sleep_ms = 0;
  explicit PoolProbe(int64_t units) : hits(static_cast<size_t>(units)) {}
  static void fn(const void* ctx, int64_t begin, int64_t end) {
    auto* p = static_cast<PoolProbe*>(const_cast<void*>(ctx));
    ++p->calls;
    if (p->in_parallel && p->in_parallel()) ++p->in_team;
    for (int64_t u = begin; u < end; ++u) ++p->hits[static_cast<size_t>(u)];
    if (p->sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(p->sleep_ms));
  }
  bool each_once() const {
    for (const auto& h : hits)
      if (h.load() != 1) return false;
    return true;
  }
};

}  // namespace

// Its jobs run on OpenMP's team, the threads libtorch's GEMMs use (a pool of its own beside it
// oversubscribed the cores while those spun); every unit once, whatever the parts and threads.
TEST(CpuPool, RunsEveryUnitOnceOnOpenMPsOwnTeam) {
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  for (int parts : {2, 3, 5})
    for (int64_t units : {1, 7, 100}) {
      PoolProbe p(units);
      ASSERT_NE(p.in_parallel, nullptr) << "libgomp is not in the process";
      cpu_pool::run(&PoolProbe::fn, &p, units, parts);
      EXPECT_TRUE(p.each_once()) << parts << " parts of " << units;
      // Parts past the units are not called; each call ran inside an OpenMP region.
      const int64_t chunk = (units + parts - 1) / parts;
      int non_empty = 0;
      for (int part = 0; part < parts; ++part) non_empty += part * chunk < units;
      EXPECT_EQ(p.calls.load(), non_empty) << parts << " parts of " << units;
      EXPECT_EQ(p.in_team.load(), p.calls.load()) << parts << " parts of " << units;
    }
  PoolProbe one(10);
  cpu_pool::run(&PoolProbe::fn, &one, 10, 1);  // one part: inline, no region
  EXPECT_TRUE(one.each_once());
  EXPECT_EQ(one.in_team.load(), 0);
  at::set_num_threads(saved);
}

// A second caller while a job runs does its job alone on its own thread; both finish.
TEST(CpuPool, ACallerThatFindsItBusyRunsItsJobItself) {
  PoolProbe a(64), b(64);
  a.sleep_ms = b.sleep_ms = 30;
  std::thread other([&] { cpu_pool::run(&PoolProbe::fn, &b, 64, 2); });
  cpu_pool::run(&PoolProbe::fn, &a, 64, 2);
  other.join();
  EXPECT_TRUE(a.each_once());
  EXPECT_TRUE(b.each_once());
}

// GNU OpenMP's team does not survive fork(): a child forked after the pool started one runs its
// jobs on its own thread instead of waiting for team threads it does not have.
TEST(CpuPool, AChildForkedAfterATeamRunsItsJobsOnItsOwnThread) {
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  PoolProbe before(32);
  cpu_pool::run(&PoolProbe::fn, &before, 32, 2);
  ASSERT_TRUE(before.each_once());
  ASSERT_EQ(before.in_team.load(), 2);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(30);  // a hang ends the child by SIGALRM, which the parent reports
    PoolProbe p(32);
    cpu_pool::run(&PoolProbe::fn, &p, 32, 2);
    ::_exit(p.each_once() && p.calls.load() == 1 && p.in_team.load() == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child wait status " << status;
  // The parent keeps its team.
  PoolProbe after(32);
  cpu_pool::run(&PoolProbe::fn, &after, 32, 2);
  EXPECT_EQ(after.in_team.load(), 2);
  at::set_num_threads(saved);
}
