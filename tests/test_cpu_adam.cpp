// The CPU Adam kernel (optim/cpu_adam.h) and its Optimizer adapter:
//  - every kernel this CPU runs (scalar, AVX2, AVX-512; one not supported is skipped alone)
//    against libtorch's Adam (L2 decay) and AdamW, with and without weight decay, over sizes
//    that hit every tail length, and against a double-precision reference without bias
//    correction: parameters within 1e-6 after 10 steps;
//  - the fused bf16 / fp16 copy-out bit-identical to c10::BFloat16 / c10::Half and to
//    Tensor::to() over NaN, inf, denormals and rounding ties;
//  - the result independent of the thread count, bit for bit;
//  - run-time ISA selection and its environment override;
//  - the adapter: parity with make_optimizer's Adam / AdamW, save/load (step count included)
//    by parameter name, checkpoints moving to and from libtorch's AdamW, and input errors.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/optimizers.h"
#include "helpers/forked_ranks.h"

namespace polytrain {
namespace cpu_adam {
// Names the kernel in gtest's messages.
void PrintTo(Isa isa, std::ostream* os) { *os << isa_name(isa); }
}  // namespace cpu_adam

namespace {

using cpu_adam::CopyOut;
using cpu_adam::Hyper;
using cpu_adam::Isa;

const std::vector<int64_t> kSizes = {1, 15, 16, 17, 22, 128, (1 << 20) + 3};

bool runs(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(cpu_adam::hardware_isa()); }

float max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

uint16_t bits_at(const at::Tensor& half_or_bf16, int64_t i) {
  uint16_t x;
  std::memcpy(&x, static_cast<const char*>(half_or_bf16.data_ptr()) + 2 * i, 2);
  return x;
}

bool bf16_is_nan(uint16_t x) { return (x & 0x7F80) == 0x7F80 && (x & 0x007F) != 0; }

/// Our kernel's state for one flat tensor.
struct Flat {
  at::Tensor p, m, v;
  explicit Flat(const at::Tensor& init) : p(init.clone()), m(at::zeros_like(init)), v(at::zeros_like(init)) {}
  void step(const Hyper& h, int64_t t, const at::Tensor& g, Isa isa, CopyOut copy = CopyOut::kNone,
            uint16_t* out = nullptr) {
    cpu_adam::step(h, t, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                   p.numel(), copy, out, isa);
  }
};

class CpuAdamIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!runs(GetParam()))
      GTEST_SKIP() << "this CPU (or OS) cannot run the " << cpu_adam::isa_name(GetParam()) << " kernel";
  }
};

// 10 steps with fresh random gradients, libtorch's Adam (L2) / AdamW next to the kernel.
TEST_P(CpuAdamIsa, MatchesTorchAdamAndAdamW) {
  const Isa isa = GetParam();
  for (int64_t n : kSizes) {
    for (bool adamw : {false, true}) {
      for (double wd : {0.0, 0.01}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << (adamw ? " AdamW" : " Adam") << " wd=" << wd);
        torch::manual_seed(n + 7);
        const auto init = torch::rand({n}) * 2 - 1;
        auto tp = init.clone().requires_grad_(true);
        std::unique_ptr<torch::optim::Optimizer> ref;
        const double lr = 2e-3;
        if (adamw)
          ref = std::make_unique<torch::optim::AdamW>(
              std::vector<at::Tensor>{tp}, torch::optim::AdamWOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
        else
          ref = std::make_unique<torch::optim::Adam>(
              std::vector<at::Tensor>{tp}, torch::optim::AdamOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
        Hyper h;
        h.lr = static_cast<float>(lr);
        h.beta1 = 0.9f;
        h.beta2 = 0.999f;
        h.eps = 1e-8f;
        h.weight_decay = static_cast<float>(wd);
        h.adam_w_mode = adamw;
        Flat ours(init);
        for (int t = 1; t <= 10; ++t) {
          const auto g = torch::randn({n});
          tp.mutable_grad() = g.clone();
          ref->step();
          ours.step(h, t, g, isa);
        }
        EXPECT_LE(max_abs_diff(ours.p, tp.detach()), 1e-6);
        EXPECT_FALSE(torch::equal(ours.p, init));  // it did move
      }
    }
  }
}

// Without bias correction (which libtorch's Adam cannot do): a reference in double.
TEST_P(CpuAdamIsa, NoBiasCorrectionMatchesDoubleReference) {
  const Isa isa = GetParam();
  for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{1000}, int64_t{4099}}) {
    for (bool adamw : {false, true}) {
      for (float wd : {0.0f, 0.01f}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << (adamw ? " AdamW" : " Adam") << " wd=" << wd);
        Hyper h;
        h.lr = 1e-3f;
        h.beta1 = 0.8f;
        h.beta2 = 0.99f;
        h.eps = 1e-6f;
        h.weight_decay = wd;
        h.adam_w_mode = adamw;
        h.bias_correction = false;
        torch::manual_seed(n);
        const auto init = torch::rand({n}) * 2 - 1;
        Flat ours(init);
        auto rp = init.to(at::kDouble), rm = at::zeros_like(rp), rv = at::zeros_like(rp);
        const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps, dwd = h.weight_decay;
        for (int t = 1; t <= 10; ++t) {
          const auto g = torch::randn({n});
          ours.step(h, t, g, isa);
          auto* p = rp.data_ptr<double>();
          auto* m = rm.data_ptr<double>();
          auto* v = rv.data_ptr<double>();
          const auto* gg = g.data_ptr<float>();
          for (int64_t i = 0; i < n; ++i) {
            double gi = gg[i];
            if (dwd > 0 && !adamw) gi += p[i] * dwd;
            m[i] = b1 * m[i] + (1 - b1) * gi;
            v[i] = b2 * v[i] + (1 - b2) * gi * gi;
            if (dwd > 0 && adamw) p[i] -= lr * dwd * p[i];
            p[i] -= lr * m[i] / (std::sqrt(v[i]) + eps);
          }
        }
        EXPECT_LE(max_abs_diff(ours.p, rp), 1e-6);
      }
    }
  }
}

// Float bit patterns whose bf16 / fp16 conversion is easy to get wrong.
std::vector<uint32_t> awkward_floats() {
  std::vector<uint32_t> b = {
      0x00000000u, 0x80000000u,              // +-0
      0x7F800000u, 0xFF800000u,              // +-inf
      0x7FC00000u, 0xFFC00000u, 0x7FC12345u, 0xFFFFFFFFu,  // quiet NaNs, with payloads
      0x7F800001u, 0xFF812345u, 0x7FBFFFFFu,  // signalling NaNs
      0x00000001u, 0x807FFFFFu, 0x00400000u, 0x00800000u,  // denormals, smallest normal
      0x7F7FFFFFu, 0xFF7FFFFFu,              // +-FLT_MAX (bf16: rounds to inf)
      0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u,  // bf16 ties (to even: down, up), near ties
      0x7F7F8000u, 0x7F7F7FFFu,              // bf16 tie at the top of the range: to inf / not
      0x3F801000u, 0x3F803000u, 0x3F800FFFu, // fp16 ties 1 + 2^-11 (down), 1 + 3*2^-11 (up)
      0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x47800000u,  // fp16 65504, just below the tie, the tie (inf), 65536
      0x33000000u, 0x33000001u, 0x33C00000u, 0x337FFFFFu,  // fp16 subnormal ties: 2^-25 -> 0, 3*2^-25 -> 2^-23
      0x387FC000u, 0x387FE000u, 0x38800000u,               // around the smallest fp16 normal
      0xB3000000u, 0xC77FF000u,              // negative ties
  };
  for (uint32_t e = 0; e < 256; ++e)  // every exponent, a few mantissas, both signs
    for (uint32_t mant : {0x000000u, 0x000001u, 0x001000u, 0x002000u, 0x003000u, 0x008000u, 0x018000u, 0x7FFFFFu})
      for (uint32_t sign : {0u, 0x80000000u}) b.push_back(sign | (e << 23) | mant);
  uint64_t state = 0x9E3779B97F4A7C15ull;  // random patterns
  for (int i = 0; i < 50000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    b.push_back(static_cast<uint32_t>(state >> 32));
  }
  return b;
}

// With lr 0, zero gradient and moments and eps 1, a step leaves every parameter as it was
// (p - 0 * (0 / 1)), so the copy-out converts exactly the patterns above.
TEST_P(CpuAdamIsa, CopyOutBitIdenticalToC10AndTensorTo) {
  const Isa isa = GetParam();
  const auto patterns = awkward_floats();
  const int64_t total = static_cast<int64_t>(patterns.size());
  Hyper h;
  h.lr = 0.0f;
  h.eps = 1.0f;
  for (int64_t offset : {0, 1, 5, 13}) {  // shifts the patterns across vector lanes and tails
    SCOPED_TRACE(::testing::Message() << "offset " << offset);
    const int64_t n = total - offset;
    auto p = at::empty({n}, at::kFloat);
    std::memcpy(p.data_ptr<float>(), patterns.data() + offset, n * 4);
    const auto grad = at::zeros({n});
    for (CopyOut copy : {CopyOut::kBf16, CopyOut::kFp16}) {
      Flat ours(p);
      auto out = at::full({n}, 0x5555, at::kShort);
      ours.step(h, 1, grad, isa, copy, reinterpret_cast<uint16_t*>(out.data_ptr()));
      const auto& after = ours.p;  // (a signalling NaN comes back quiet; compare with what is there)
      const auto via_to = after.to(copy == CopyOut::kBf16 ? at::kBFloat16 : at::kHalf);
      const float* f = after.data_ptr<float>();
      int bad = 0;
      for (int64_t i = 0; i < n && bad < 10; ++i) {
        const uint16_t got = bits_at(out, i);
        uint32_t in;
        std::memcpy(&in, &f[i], 4);
        if (copy == CopyOut::kBf16) {
          const uint16_t c10_bits = c10::BFloat16(f[i]).x;
          const uint16_t to_bits = bits_at(via_to, i);
          // Tensor::to's vectorised path writes NaN as 0xFFFF, c10::BFloat16 as 0x7FC0 (ours):
          // both NaN. Every other value bit for bit.
          const bool ok = got == c10_bits && (std::isnan(f[i]) ? bf16_is_nan(to_bits) : got == to_bits);
          if (!ok) {
            ++bad;
            ADD_FAILURE() << std::hex << "bf16 of 0x" << in << ": got 0x" << got << ", c10 0x" << c10_bits
                          << ", Tensor::to 0x" << to_bits;
          }
        } else {
          const uint16_t c10_bits = c10::Half(f[i]).x;
          const uint16_t to_bits = bits_at(via_to, i);
          if (got != c10_bits || got != to_bits) {
            ++bad;
            ADD_FAILURE() << std::hex << "fp16 of 0x" << in << ": got 0x" << got << ", c10 0x" << c10_bits
                          << ", Tensor::to 0x" << to_bits;
          }
        }
      }
      // The parameter itself is untouched, NaNs aside (quieted).
      const auto same = (after == p) | (after.isnan() & p.isnan());
      EXPECT_TRUE(same.all().item<bool>());
    }
  }
}

// A real trajectory with copy-out: the fp32 results are those of the run without it, and the
// half copies are the conversions of the fp32 results.
TEST_P(CpuAdamIsa, CopyOutDuringRealStepsMatchesConversion) {
  const Isa isa = GetParam();
  const int64_t n = (1 << 20) + 3;
  torch::manual_seed(3);
  const auto init = torch::randn({n}) * 3;
  Hyper h;
  h.weight_decay = 0.01f;
  Flat plain(init), bf(init), fp(init);
  auto out_bf = at::empty({n}, at::kBFloat16), out_fp = at::empty({n}, at::kHalf);
  for (int t = 1; t <= 3; ++t) {
    const auto g = torch::randn({n});
    plain.step(h, t, g, isa);
    bf.step(h, t, g, isa, CopyOut::kBf16, reinterpret_cast<uint16_t*>(out_bf.data_ptr()));
    fp.step(h, t, g, isa, CopyOut::kFp16, reinterpret_cast<uint16_t*>(out_fp.data_ptr()));
  }
  for (Flat* f : {&bf, &fp}) {
    EXPECT_TRUE(torch::equal(f->p, plain.p));
    EXPECT_TRUE(torch::equal(f->m, plain.m));
    EXPECT_TRUE(torch::equal(f->v, plain.v));
  }
  EXPECT_TRUE(torch::equal(out_bf.view(at::kShort), plain.p.to(at::kBFloat16).view(at::kShort)));
  EXPECT_TRUE(torch::equal(out_fp.view(at::kShort), plain.p.to(at::kHalf).view(at::kShort)));
}

// The same step on 1 and on 2 threads: identical bits (threads split the range anywhere the
// grain allows; every element is computed the same way wherever it falls).
TEST_P(CpuAdamIsa, ThreadCountDoesNotChangeBits) {
  const Isa isa = GetParam();
  const int saved_threads = at::get_num_threads();
  for (int64_t n : {int64_t{70001}, int64_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    torch::manual_seed(11);
    const auto init = torch::randn({n});
    std::vector<at::Tensor> grads;
    for (int t = 0; t < 3; ++t) grads.push_back(torch::randn({n}));
    Hyper h;
    h.weight_decay = 0.01f;
    auto run = [&](int threads, at::Tensor& out) {
      at::set_num_threads(threads);
      EXPECT_EQ(at::get_num_threads(), threads);
      Flat f(init);
      for (int t = 1; t <= 3; ++t)
        f.step(h, t, grads[t - 1], isa, CopyOut::kBf16, reinterpret_cast<uint16_t*>(out.data_ptr()));
      return f;
    };
    auto out1 = at::empty({n}, at::kShort), out2 = at::empty({n}, at::kShort);
    const Flat one = run(1, out1);
    const Flat two = run(2, out2);
    EXPECT_TRUE(torch::equal(one.p, two.p));
    EXPECT_TRUE(torch::equal(one.m, two.m));
    EXPECT_TRUE(torch::equal(one.v, two.v));
    EXPECT_TRUE(torch::equal(out1, out2));
  }
  at::set_num_threads(saved_threads);
}

// The OpenMP team's threads exist in the parent only: a forked child (ZeRO's tests fork their
// ranks) must run its jobs on its own thread rather than wait for threads it does not have.
TEST_P(CpuAdamIsa, ThreadsWorkInAForkedChild) {
  const Isa isa = GetParam();
  const int saved_threads = at::get_num_threads();
  const int64_t n = 200003;
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) p0[i] = std::sin(0.001f * i), g[i] = std::cos(0.37f * i);
  Hyper h;
  auto run = [&](std::vector<float>& p) {
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    p = p0;
    for (int t = 1; t <= 2; ++t) cpu_adam::step(h, t, p.data(), g.data(), m.data(), v.data(), n, CopyOut::kNone, nullptr, isa);
  };
  at::set_num_threads(2);
  std::vector<float> expected;
  run(expected);  // the parent's pool now has its worker
  const auto status = testing::run_ranks(1, std::chrono::seconds(60), [&](int) {
    at::set_num_threads(2);  // (run_ranks sets 1)
    std::vector<float> got;
    run(got);
    return got == expected ? 0 : 3;
  });
  at::set_num_threads(saved_threads);
  ASSERT_EQ(status.size(), 1u);
  EXPECT_TRUE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << "child wait status " << status[0];
}

INSTANTIATE_TEST_SUITE_P(Kernels, CpuAdamIsa, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return cpu_adam::isa_name(info.param); });

// Run-time detection agrees with the compiler's own cpuid probe, and the environment can
// lower the choice but not raise it.
TEST(CpuAdamDispatch, DetectsTheCpuAndHonoursTheEnvironment) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  Isa expected = Isa::kScalar;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) expected = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    expected = Isa::kAvx512;
  EXPECT_EQ(cpu_adam::hardware_isa(), expected) << cpu_adam::isa_name(cpu_adam::hardware_isa());
#endif
  const char* before = std::getenv("POLYTRAIN_CPU_ADAM_ISA");
  const std::string saved = before ? before : "";
  const Isa hw = cpu_adam::hardware_isa();
  ::unsetenv("POLYTRAIN_CPU_ADAM_ISA");
  EXPECT_EQ(cpu_adam::detect_isa(), hw);
  ::setenv("POLYTRAIN_CPU_ADAM_ISA", "scalar", 1);
  EXPECT_EQ(cpu_adam::detect_isa(), Isa::kScalar);
  ::setenv("POLYTRAIN_CPU_ADAM_ISA", "AVX2", 1);
  EXPECT_EQ(cpu_adam::detect_isa(), runs(Isa::kAvx2) ? Isa::kAvx2 : hw);
  ::setenv("POLYTRAIN_CPU_ADAM_ISA", "avx512", 1);
  EXPECT_EQ(cpu_adam::detect_isa(), hw);  // never above what the CPU has
  ::setenv("POLYTRAIN_CPU_ADAM_ISA", "sse", 1);
  EXPECT_THROW(cpu_adam::detect_isa(), InputError);
  if (before) ::setenv("POLYTRAIN_CPU_ADAM_ISA", saved.c_str(), 1);
  else ::unsetenv("POLYTRAIN_CPU_ADAM_ISA");
  EXPECT_STREQ(cpu_adam::isa_name(Isa::kAvx512), "avx512");
}

TEST(CpuAdamDispatch, RejectsBadCalls) {
  float p = 1, g = 1, m = 0, v = 0;
  Hyper h;
  EXPECT_THROW(cpu_adam::step(h, 0, &p, &g, &m, &v, 1), InternalError);  // step is 1-based
  EXPECT_THROW(cpu_adam::step(h, 1, &p, &g, &m, &v, 1, CopyOut::kBf16, nullptr), InternalError);
  if (!runs(Isa::kAvx512)) {
    EXPECT_THROW(cpu_adam::step(h, 1, &p, &g, &m, &v, 1, CopyOut::kNone, nullptr, Isa::kAvx512), InternalError);
  }
  cpu_adam::step(h, 1, &p, &g, &m, &v, 0);  // nothing to do
  EXPECT_EQ(p, 1.0f);
}

// ---- the Optimizer adapter ----------------------------------------------------------------

NamedParams model_params(int64_t seed) {
  torch::manual_seed(seed);
  NamedParams out;
  out.emplace_back("encoder.dense.weight", (torch::rand({24, 37}) - 0.5).requires_grad_(true));
  out.emplace_back("encoder.dense.bias", (torch::rand({37}) - 0.5).requires_grad_(true));
  out.emplace_back("encoder.LayerNorm.weight", torch::ones({5}).requires_grad_(true));
  out.emplace_back("head.weight", (torch::rand({3, 70001}) - 0.5).requires_grad_(true));  // > one thread's grain
  return out;
}

NamedParams clone_params(const NamedParams& from) {
  NamedParams out;
  for (const auto& [n, p] : from) out.emplace_back(n, p.detach().clone().requires_grad_(true));
  return out;
}

void set_grads(NamedParams& params, int64_t seed) {
  torch::manual_seed(seed);
  for (auto& [n, p] : params) p.mutable_grad() = torch::randn_like(p);
}

OptimizerConfig adam_config(const std::string& type, bool adam_w_mode) {
  OptimizerConfig cfg;
  cfg.type = type;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.05;
  cfg.adam_w_mode = adam_w_mode;
  return cfg;
}

std::string save_to_string(const Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::stringstream buffer;
  archive.save_to(buffer);
  return buffer.str();
}

void load_from_string(Optimizer& opt, const std::string& bytes) {
  std::stringstream buffer(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(buffer);
  opt.load(archive, "test checkpoint");
}

void expect_close(const NamedParams& a, const NamedParams& b, double tol) {
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(max_abs_diff(a[i].second.detach(), b[i].second.detach()), tol) << a[i].first;
}

// Against make_optimizer over the same groups (decay / no decay): AdamW, and Adam in both modes.
TEST(CpuAdamOptimizer, MatchesMakeOptimizer) {
  for (const auto& [type, w_mode] : std::vector<std::pair<std::string, bool>>{
           {"AdamW", true}, {"Adam", true}, {"Adam", false}, {"AdamW", false}}) {
    SCOPED_TRACE(type + (w_mode ? " adam_w_mode" : " L2"));
    const auto cfg = adam_config(type, w_mode);
    auto ref_params = model_params(1);
    auto our_params = clone_params(ref_params);
    auto ref = make_optimizer(cfg, split_by_decay(cfg, ref_params));
    auto ours = make_cpu_adam(cfg, split_by_decay(cfg, our_params));
    EXPECT_EQ(ours->name(), type);
    for (int t = 1; t <= 6; ++t) {
      set_grads(ref_params, 100 + t);
      set_grads(our_params, 100 + t);
      ref->step();
      ours->step();
    }
    expect_close(ref_params, our_params, 1e-6);
  }
}

// Save after 3 steps, load into a fresh optimizer over fresh tensors, 3 more steps: equal to
// the uninterrupted run bit for bit (a step count restarted at 0 would change the bias
// correction of step 4), and still within 1e-6 of libtorch's AdamW.
TEST(CpuAdamOptimizer, SaveLoadContinuesIdentically) {
  const auto cfg = adam_config("AdamW", true);
  auto params = model_params(2);
  auto torch_params = clone_params(params);
  auto opt = make_cpu_adam(cfg, split_by_decay(cfg, params));
  auto ref = make_optimizer(cfg, split_by_decay(cfg, torch_params));
  for (int t = 1; t <= 3; ++t) {
    set_grads(params, t);
    set_grads(torch_params, t);
    opt->step();
    ref->step();
  }
  const std::string bytes = save_to_string(*opt);
  auto resumed = clone_params(params);
  auto opt2 = make_cpu_adam(cfg, split_by_decay(cfg, resumed));
  load_from_string(*opt2, bytes);
  for (int t = 4; t <= 6; ++t) {
    set_grads(params, t);
    set_grads(resumed, t);
    set_grads(torch_params, t);
    opt->step();
    opt2->step();
    ref->step();
  }
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(params[i].second, resumed[i].second)) << params[i].first;
  expect_close(torch_params, resumed, 1e-6);
}

// The archive layout is make_optimizer's AdamW: a checkpoint moves either way.
TEST(CpuAdamOptimizer, CheckpointsMoveToAndFromLibtorchAdamW) {
  const auto cfg = adam_config("AdamW", true);
  for (bool from_torch : {true, false}) {
    SCOPED_TRACE(from_torch ? "libtorch -> CPU Adam" : "CPU Adam -> libtorch");
    auto a_params = model_params(3);
    auto straight_params = clone_params(a_params);
    auto make_a = [&](NamedParams& p) {
      return from_torch ? make_optimizer(cfg, split_by_decay(cfg, p)) : make_cpu_adam(cfg, split_by_decay(cfg, p));
    };
    auto make_b = [&](NamedParams& p) {
      return from_torch ? make_cpu_adam(cfg, split_by_decay(cfg, p)) : make_optimizer(cfg, split_by_decay(cfg, p));
    };
    auto a = make_a(a_params);
    auto straight = make_a(straight_params);
    for (int t = 1; t <= 3; ++t) {
      set_grads(a_params, t);
      set_grads(straight_params, t);
      a->step();
      straight->step();
    }
    auto b_params = clone_params(a_params);
    auto b = make_b(b_params);
    load_from_string(*b, save_to_string(*a));
    for (int t = 4; t <= 6; ++t) {
      set_grads(b_params, t);
      set_grads(straight_params, t);
      b->step();
      straight->step();
    }
    expect_close(straight_params, b_params, 1e-6);
  }
}

TEST(CpuAdamOptimizer, LoadChecksNamesAndShapes) {
  const auto cfg = adam_config("AdamW", true);
  NamedParams saved_params{{"w", torch::rand({4, 5}).requires_grad_(true)},
                           {"b", torch::rand({5}).requires_grad_(true)}};
  auto opt = make_cpu_adam(cfg, {ParamGroup{saved_params, 0.0}});
  set_grads(saved_params, 1);
  opt->step();
  const std::string bytes = save_to_string(*opt);

  NamedParams other_shape{{"w", torch::rand({5, 4}).requires_grad_(true)},
                          {"b", torch::rand({5}).requires_grad_(true)}};
  auto opt2 = make_cpu_adam(cfg, {ParamGroup{other_shape, 0.0}});
  try {
    load_from_string(*opt2, bytes);
    ADD_FAILURE() << "a state of another shape loaded";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'w'"), std::string::npos) << what;
    EXPECT_NE(what.find("test checkpoint"), std::string::npos) << what;
  }
  NamedParams other_name{{"w", torch::rand({4, 5}).requires_grad_(true)},
                         {"gamma", torch::rand({5}).requires_grad_(true)}};
  auto opt3 = make_cpu_adam(cfg, {ParamGroup{other_name, 0.0}});
  try {
    load_from_string(*opt3, bytes);
    ADD_FAILURE() << "a state for another parameter loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'gamma'"), std::string::npos) << e.what();
  }
  // A failed load leaves the optimizer as it was: no state, step count 0 (the next step is
  // a first step, equal to a fresh optimizer's).
  auto fresh_params = clone_params(other_shape);
  auto fresh = make_cpu_adam(cfg, {ParamGroup{fresh_params, 0.0}});
  set_grads(other_shape, 9);
  set_grads(fresh_params, 9);
  opt2->step();
  fresh->step();
  EXPECT_TRUE(torch::equal(other_shape[0].second, fresh_params[0].second));
}

TEST(CpuAdamOptimizer, RejectsWhatItCannotStep) {
  const auto cfg = adam_config("AdamW", true);
  auto expect_input_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no InputError (expected one mentioning " << needle << ")";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_input_error(
      [&] { make_cpu_adam(cfg, {ParamGroup{{{"fp64.weight", torch::rand({3}, torch::kDouble)}}, 0.0}}); },
      "fp64.weight");
  expect_input_error(
      [&] { make_cpu_adam(cfg, {ParamGroup{{{"transposed", torch::rand({3, 4}).t()}}, 0.0}}); }, "transposed");
  auto shared = torch::rand({3});
  expect_input_error([&] { make_cpu_adam(cfg, {ParamGroup{{{"a", shared}, {"tied", shared}}, 0.0}}); }, "tied");
  auto amsgrad = cfg;
  amsgrad.amsgrad = true;
  expect_input_error([&] { make_cpu_adam(amsgrad, {ParamGroup{{{"w", torch::rand({3})}}, 0.0}}); }, "amsgrad");
  auto bad_beta = cfg;
  bad_beta.beta2 = 1.0;
  expect_input_error([&] { make_cpu_adam(bad_beta, {ParamGroup{{{"w", torch::rand({3})}}, 0.0}}); }, "betas[1]");

  auto opt = make_cpu_adam(cfg, {ParamGroup{{{"w", torch::rand({3})}}, 0.0}});
  EXPECT_TRUE(opt->has_beta1());
  expect_input_error([&] { opt->set_beta1(1.0); }, "beta1");
  opt->set_beta1(0.85);
  EXPECT_THROW(opt->torch_optimizer(), Error);
}

TEST(CpuAdamOptimizer, ZeroGradLrAndParametersWithoutGradient) {
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  auto w = torch::rand({100}).requires_grad_(true);
  auto frozen = torch::rand({7}).requires_grad_(true);
  auto opt = make_cpu_adam(cfg, {ParamGroup{{{"w", w}, {"frozen", frozen}}, 0.0}});
  const auto frozen_before = frozen.detach().clone();
  w.mutable_grad() = torch::ones({100});
  const void* grad_storage = w.grad().data_ptr();
  opt->set_lr(0.0);
  const auto w_before = w.detach().clone();
  opt->step();  // lr 0: nothing moves
  EXPECT_TRUE(torch::equal(w, w_before));
  opt->set_lr(0.1);
  opt->step();
  EXPECT_FALSE(torch::equal(w, w_before));
  EXPECT_TRUE(torch::equal(frozen, frozen_before));  // no gradient: left alone
  opt->zero_grad();
  EXPECT_EQ(w.grad().data_ptr(), grad_storage);  // zeroed in place
  EXPECT_EQ(w.grad().abs().sum().item<float>(), 0.0f);
  EXPECT_FALSE(frozen.grad().defined());
}

}  // namespace
}  // namespace polytrain
