// The fp32 CPU matmul override (ops/cpu_gemm.h) against fp64 references, on every engine:
// mm, addmm, addmm_, bmm and the out forms, over the layouts the models and autograd hand them
// (transposed operands, column blocks of wider matrices, offsets, single rows and columns), the
// cases that must go to ATen's kernel (strided operands, aliasing or strided outputs, other
// dtypes, empty shapes) and ATen's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/error.h"
#include "polytrain/ops/cpu_gemm.h"

using namespace polytrain;
using cpu_gemm::Engine;

namespace {

class CpuGemm : public ::testing::TestWithParam<Engine> {
 protected:
  void SetUp() override {
    before_ = cpu_gemm::set_engine(GetParam());
    threads_ = at::get_num_threads();
    at::set_num_threads(2);  // the batch split needs two threads (ctest gives one)
  }
  void TearDown() override {
    cpu_gemm::set_engine(before_);
    at::set_num_threads(threads_);
  }
  Engine before_ = Engine::kAten;
  int threads_ = 1;
};

// Within fp32 accumulation of k products of unit-variance values.
void expect_near_ref(const at::Tensor& got, const at::Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), at::kFloat) << what;
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const double err = (got.to(at::kDouble) - ref).abs().max().item<double>();
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  EXPECT_LE(err, 2e-5 * scale) << what;
}

at::Tensor d(const at::Tensor& t) { return t.to(at::kDouble); }

// A [rows, cols] fp32 matrix in the layout named: "n" contiguous, "t" the transpose of a
// contiguous [cols, rows], "block" a column block of a wider matrix at an offset (leading
// dimension > cols), "tblock" the transpose of such a block, "strided" every other element
// (no BLAS operand).
at::Tensor matrix(int64_t rows, int64_t cols, const std::string& layout, int seed) {
  torch::manual_seed(seed);
  if (layout == "n") return torch::randn({rows, cols});
  if (layout == "t") return torch::randn({cols, rows}).t();
  if (layout == "block") return torch::randn({rows, cols + 9}).narrow(1, 5, cols);
  if (layout == "tblock") return torch::randn({cols, rows + 7}).narrow(1, 3, rows).t();
  if (layout == "strided") return torch::randn({rows * 2, cols * 2}).slice(0, 0, rows * 2, 2).slice(1, 0, cols * 2, 2);
  ADD_FAILURE() << layout;
  return {};
}

const char* kLayouts[] = {"n", "t", "block", "tblock", "strided"};

}  // namespace

static CpuFeatures recorded(const std::string& file) {
  std::ifstream in(std::string(POLYTRAIN_SOURCE_DIR) + "/tests/data/cpuinfo/" + file);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << file;
  return cpu_features_from_cpuinfo(ss.str());
}

TEST(CpuGemmEngine, ChosenByTheRecordedCpusTheBuildAndTheVariable) {
  using cpu_gemm::choose_engine;
  // oneDNN on AVX-512 CPUs of either vendor (measured on the Xeon of model 167 and on Zen 5);
  // the batch split alone on AVX2-only CPUs.
  for (const char* avx512 : {"intel_xeon_6_167_amx.txt", "intel_xeon_6_207_amx.txt", "amd_epyc_zen4_25_17.txt",
                             "amd_epyc_zen5_26_2.txt"}) {
    EXPECT_EQ(choose_engine(recorded(avx512), true, nullptr), Engine::kOneDnn) << avx512;
    EXPECT_EQ(choose_engine(recorded(avx512), false, nullptr), Engine::kBlas) << avx512;  // a build without oneDNN
  }
  for (const char* other : {"intel_xeon_broadwell_avx2_6_79.txt", "amd_epyc_zen3_25_1.txt"})
    EXPECT_EQ(choose_engine(recorded(other), true, nullptr), Engine::kBlas) << other;
  const auto zen3 = recorded("amd_epyc_zen3_25_1.txt");
  EXPECT_EQ(choose_engine(zen3, true, "onednn"), Engine::kOneDnn);
  EXPECT_EQ(choose_engine(zen3, false, "onednn"), Engine::kBlas);
  EXPECT_EQ(choose_engine(recorded("intel_xeon_6_207_amx.txt"), true, "aten"), Engine::kAten);
  EXPECT_EQ(choose_engine(recorded("intel_xeon_6_207_amx.txt"), true, "blas"), Engine::kBlas);
  EXPECT_EQ(choose_engine(zen3, true, ""), Engine::kBlas);
}

TEST(CpuGemmEngine, ThisProcessRunsThisMachinesChoice) {
  EXPECT_EQ(cpu_gemm::engine(), cpu_gemm::choose_engine(host_cpu_features(), cpu_gemm::have_onednn(),
                                                        std::getenv("POLYTRAIN_GEMM")));
  const Engine want = cpu_gemm::engine();
  EXPECT_NE(cpu_gemm::describe().find(want == Engine::kOneDnn ? "oneDNN " : want == Engine::kBlas ? "BLAS" : "ATen"),
            std::string::npos)
      << cpu_gemm::describe();
}

// oneDNN's bf16 GEMM API for the LM head's backward: on AVX512-BF16 CPUs without AMX (Zen 4,
// Zen 5), with oneDNN built in and its engine chosen; on AMX CPUs ATen's bf16 matmul (oneDNN's
// primitive on the tiles) stays.
TEST(CpuGemmEngine, Bf16GemmOnAvx512Bf16WithoutAmx) {
  using cpu_gemm::bf16_gemm_fits;
  for (const char* f : {"amd_epyc_zen4_25_17.txt", "amd_epyc_zen5_26_2.txt"}) {
    EXPECT_TRUE(bf16_gemm_fits(recorded(f), true, Engine::kOneDnn)) << f;
    EXPECT_FALSE(bf16_gemm_fits(recorded(f), false, Engine::kOneDnn)) << f;
    EXPECT_FALSE(bf16_gemm_fits(recorded(f), true, Engine::kBlas)) << f;
  }
  for (const char* f : {"intel_xeon_6_167_amx.txt", "intel_xeon_6_207_amx.txt", "intel_xeon_broadwell_avx2_6_79.txt",
                        "amd_epyc_zen3_25_1.txt"})
    EXPECT_FALSE(bf16_gemm_fits(recorded(f), true, Engine::kOneDnn)) << f;
}

// This machine: available exactly where it fits (Debian's oneDNN exports the GEMM); where it
// runs, every operand orientation and beta 0 / 1 against fp32 products of the same bf16
// operands (fp32 accumulation both); elsewhere a call is a clear error, not a wrong result.
TEST(CpuGemmEngine, Bf16GemmMatchesFp32ProductsOfTheSameOperands) {
  const bool fits = cpu_gemm::bf16_gemm_fits(host_cpu_features(), cpu_gemm::have_onednn(), cpu_gemm::engine());
  EXPECT_EQ(cpu_gemm::bf16_gemm_available(), fits);
  const int64_t m = 37, n = 29, k = 301;
  auto c = torch::zeros({m, n});
  if (!fits) {
    const auto a = torch::zeros({m, k}, at::kBFloat16), b = torch::zeros({k, n}, at::kBFloat16);
    EXPECT_THROW(cpu_gemm::gemm_bf16('N', 'N', m, n, k, 1.0f, a.data_ptr<at::BFloat16>(), k,
                                     b.data_ptr<at::BFloat16>(), n, 0.0f, c.data_ptr<float>(), n),
                 c10::Error);
    return;
  }
  for (char ta : {'N', 'T'}) {
    for (char tb : {'N', 'T'}) {
      const auto a = (ta == 'N' ? torch::randn({m, k}) : torch::randn({k, m})).to(at::kBFloat16);
      const auto b = (tb == 'N' ? torch::randn({k, n}) : torch::randn({n, k})).to(at::kBFloat16);
      const auto want_ab = at::mm(ta == 'N' ? a.to(at::kDouble) : a.to(at::kDouble).t(),
                                  tb == 'N' ? b.to(at::kDouble) : b.to(at::kDouble).t());
      const auto c0 = torch::randn({m, n});
      for (float beta : {0.0f, 1.0f}) {
        c.copy_(c0);
        if (beta == 0.0f) c.fill_(std::numeric_limits<float>::quiet_NaN());  // beta 0 ignores C
        cpu_gemm::gemm_bf16(ta, tb, m, n, k, 0.5f, a.data_ptr<at::BFloat16>(), a.size(1), b.data_ptr<at::BFloat16>(),
                            b.size(1), beta, c.data_ptr<float>(), n);
        const auto want = 0.5 * want_ab + beta * c0.to(at::kDouble);
        EXPECT_LT((c.to(at::kDouble) - want).abs().max().item<double>(), 1e-3) << ta << tb << " beta " << beta;
      }
    }
  }
}

TEST(CpuGemmEngine, AnUnknownNameIsAnInputErrorNamingTheVariable) {
  const char* old = std::getenv("POLYTRAIN_GEMM");
  const std::string saved = old ? old : "";
  ::setenv("POLYTRAIN_GEMM", "fastest", 1);
  try {
    cpu_gemm::describe();
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "POLYTRAIN_GEMM=fastest: expected aten, blas or onednn");
  }
  if (old) ::setenv("POLYTRAIN_GEMM", saved.c_str(), 1);
  else ::unsetenv("POLYTRAIN_GEMM");
}

TEST_P(CpuGemm, MmOverEveryLayoutPair) {
  for (const char* la : kLayouts)
    for (const char* lb : kLayouts)
      for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{67, 45, 130}, {1, 80, 70}, {90, 1, 70},
                                    {40, 50, 1}, {256, 96, 40}}) {
        const auto a = matrix(m, k, la, 1), b = matrix(k, n, lb, 2);
        const std::string what = std::string(la) + " x " + lb + " " + std::to_string(m) + "x" + std::to_string(n) +
                                 "x" + std::to_string(k);
        expect_near_ref(at::mm(a, b), at::mm(d(a), d(b)), "mm " + what);
        auto out = torch::full({m, n}, 7.0f);
        at::mm_out(out, a, b);
        expect_near_ref(out, at::mm(d(a), d(b)), "mm.out " + what);
      }
}

TEST_P(CpuGemm, AddmmBroadcastsScalesAndIgnoresSelfWhenBetaIsZero) {
  const int64_t m = 70, n = 90, k = 120;
  for (const char* la : {"n", "t", "tblock"})
    for (const char* lb : {"n", "t", "block"}) {
      const auto a = matrix(m, k, la, 3), b = matrix(k, n, lb, 4);
      const auto prod = at::mm(d(a), d(b));
      for (const auto& self : {torch::randn({n}), torch::randn({m, 1}), torch::randn({m, n}), torch::randn({1, n})}) {
        const std::string what = std::string(la) + " x " + lb + " self " + std::to_string(self.dim());
        expect_near_ref(at::addmm(self, a, b), d(self) + prod, "addmm " + what);
        expect_near_ref(at::addmm(self, a, b, 0.5, -2.0), 0.5 * d(self) - 2.0 * prod, "addmm beta alpha " + what);
        auto out = torch::empty({m, n});
        at::addmm_out(out, self, a, b, 1.5, 0.25);
        expect_near_ref(out, 1.5 * d(self) + 0.25 * prod, "addmm.out " + what);
      }
      const auto nan_self = torch::full({m, n}, std::numeric_limits<float>::quiet_NaN());
      expect_near_ref(at::addmm(nan_self, a, b, 0.0, 1.0), prod, "beta 0 ignores NaN self");
      auto acc = torch::randn({m, n});
      const auto acc_ref = d(acc);
      acc.addmm_(a, b);
      expect_near_ref(acc, acc_ref + prod, "addmm_ " + std::string(la) + lb);
      // addmm_ into a column block of a wider matrix (leading dimension > n): only the block moves.
      auto wide = torch::randn({m, n + 6});
      const auto wide_ref = d(wide);
      auto block = wide.narrow(1, 2, n);
      block.addmm_(a, b, 2.0, 1.0);
      expect_near_ref(wide.narrow(1, 2, n), 2.0 * wide_ref.narrow(1, 2, n) + prod, "addmm_ into a block");
      expect_near_ref(wide.narrow(1, 0, 2), wide_ref.narrow(1, 0, 2), "left of the block");
      expect_near_ref(wide.narrow(1, n + 2, 4), wide_ref.narrow(1, n + 2, 4), "right of the block");
    }
}

TEST_P(CpuGemm, OutputsThatAreNoPlainBlockOrAliasAnInputStayCorrect) {
  const int64_t m = 64, n = 48, k = 80;
  const auto a = matrix(m, k, "n", 5), b = matrix(k, n, "n", 6);
  const auto prod = at::mm(d(a), d(b));
  auto col_major = torch::empty({n, m}).t();  // out with columns contiguous
  at::mm_out(col_major, a, b);
  expect_near_ref(col_major, prod, "column-major out");
  auto wrong = torch::empty({0});  // resized by ATen's rules
  at::mm_out(wrong, a, b);
  expect_near_ref(wrong, prod, "resized out");
  // out = self (addmm.out onto its own bias matrix) and out aliasing an operand.
  auto self = torch::randn({m, n});
  const auto self_ref = d(self);
  at::addmm_out(self, self, a, b);
  expect_near_ref(self, self_ref + prod, "out is self");
  auto sq = torch::randn({m, m});
  const auto sq_ref = d(sq);
  sq.addmm_(sq, matrix(m, m, "n", 7));
  expect_near_ref(sq, sq_ref + at::mm(sq_ref, d(matrix(m, m, "n", 7))), "addmm_ whose self is mat1");
}

TEST_P(CpuGemm, OtherDtypesEmptyShapesAndErrorsAreAtens) {
  const auto a = torch::randn({30, 40}, at::kDouble), b = torch::randn({40, 20}, at::kDouble);
  EXPECT_TRUE(at::mm(a, b).equal(at::mm(a.contiguous(), b.contiguous())));
  const auto bf = at::mm(a.to(at::kBFloat16), b.to(at::kBFloat16));
  EXPECT_EQ(bf.scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::mm(torch::randn({0, 5}), torch::randn({5, 7})).sizes(), (std::vector<int64_t>{0, 7}));
  EXPECT_TRUE(at::mm(torch::randn({4, 0}), torch::randn({0, 7})).equal(torch::zeros({4, 7})));
  const auto bias = torch::randn({7});
  EXPECT_TRUE(at::addmm(bias, torch::randn({4, 0}), torch::randn({0, 7})).equal(bias.expand({4, 7})));
  EXPECT_THROW(at::mm(torch::randn({64, 64}), torch::randn({65, 64})), c10::Error);
  EXPECT_THROW(at::addmm(torch::randn({5}), torch::randn({64, 64}), torch::randn({64, 64})), c10::Error);
  EXPECT_THROW(at::bmm(torch::randn({4, 64, 64}), torch::randn({3, 64, 64})), c10::Error);
}

TEST_P(CpuGemm, BmmOverBatchesLayoutsAndInsideAParallelRegion) {
  for (const int64_t batch : {1, 2, 3, 8, 9}) {
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        torch::manual_seed(batch * 4 + ta * 2 + tb);
        const int64_t m = 48, n = 40, k = 64;
        const auto a = ta ? torch::randn({batch, k, m}).transpose(1, 2) : torch::randn({batch, m, k});
        const auto b = tb ? torch::randn({batch, n, k}).transpose(1, 2) : torch::randn({batch, k, n});
        const std::string what = "batch " + std::to_string(batch) + (ta ? " T" : " N") + (tb ? "T" : "N");
        const auto ref = at::bmm(d(a), d(b));
        expect_near_ref(at::bmm(a, b), ref, "bmm " + what);
        auto out = torch::full({batch, m, n}, 3.0f);
        at::bmm_out(out, a, b);
        expect_near_ref(out, ref, "bmm.out " + what);
        expect_near_ref(torch::matmul(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0), ref, "matmul 4-D " + what);
      }
  }
  // A batch whose items overlap in memory: an expanded (stride 0) operand.
  const auto shared = torch::randn({1, 32, 64}).expand({6, 32, 64});
  const auto bb = torch::randn({6, 64, 40});
  expect_near_ref(at::bmm(shared, bb), at::bmm(d(shared), d(bb)), "stride-0 batch");
  // Called from inside a parallel region (the split is not nested): each thread's result.
  const auto x = torch::randn({4, 8, 32, 48}), y = torch::randn({4, 8, 48, 32});
  std::vector<at::Tensor> got(4);
  at::parallel_for(0, 4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) got[i] = at::bmm(x[i], y[i]);
  });
  for (int64_t i = 0; i < 4; ++i) expect_near_ref(got[i], at::bmm(d(x[i]), d(y[i])), "in a region");
}

TEST_P(CpuGemm, LinearLayerGradientsMatchFp64) {
  torch::manual_seed(11);
  auto x = torch::randn({4, 33, 96}, torch::requires_grad());
  auto w = torch::randn({96, 160}, torch::requires_grad());
  auto bias = torch::randn({160}, torch::requires_grad());
  auto y = torch::addmm(bias, x.view({-1, 96}), w);
  auto g = torch::randn_like(y);
  y.backward(g);
  auto xd = d(x.detach()).requires_grad_(), wd = d(w.detach()).requires_grad_(), bd = d(bias.detach()).requires_grad_();
  auto yd = torch::addmm(bd, xd.view({-1, 96}), wd);
  yd.backward(d(g));
  expect_near_ref(y.detach(), yd.detach(), "forward");
  expect_near_ref(x.grad(), xd.grad(), "input gradient");
  expect_near_ref(w.grad(), wd.grad(), "weight gradient");
  expect_near_ref(bias.grad(), bd.grad(), "bias gradient");
}

INSTANTIATE_TEST_SUITE_P(Engines, CpuGemm, ::testing::Values(Engine::kAten, Engine::kBlas, Engine::kOneDnn),
                         [](const auto& info) {
                           return info.param == Engine::kAten ? "aten" : info.param == Engine::kBlas ? "blas" : "onednn";
                         });

TEST(CpuGemmThreads, SingleThreadedHoldsTheCallingThreadToOneAndRestores) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  {
    const cpu_gemm::SingleThreaded one;
    EXPECT_EQ(at::get_num_threads(), 1);
    // A product under it is the same product.
    const auto a = torch::randn({64, 80}), b = torch::randn({80, 48});
    auto c = torch::empty({64, 48});
    cpu_gemm::sgemm('N', 'N', 64, 48, 80, 1.0f, a.data_ptr<float>(), 80, b.data_ptr<float>(), 48, 0.0f,
                    c.data_ptr<float>(), 48);
    EXPECT_LT((c.to(at::kDouble) - at::mm(a.to(at::kDouble), b.to(at::kDouble))).abs().max().item<double>(), 1e-4);
  }
  EXPECT_EQ(at::get_num_threads(), 2);
  at::set_num_threads(before);
}
