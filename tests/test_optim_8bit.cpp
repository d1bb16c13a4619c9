// The 8-bit optimizers (optim/blockwise_quant.h, cpu_optim_8bit.h, optimizers_8bit.h):
//  - the dynamic codes against values worked out by hand from the paper's formula (and within
//    2 ulp of it evaluated exactly), the table search against a brute-force nearest-code
//    search, a block quantized by hand, and block-wise quantization of three blocks (the last
//    partial) against a plain reference with its error bound;
//  - each kernel (scalar, AVX2, AVX-512; one the CPU lacks is skipped) against "dequantize, CPU
//    Adam in fp32, requantize" (moments bit for bit, weights within rounding), bit-identical to
//    the scalar kernel for Adam, AdamW and LAMB over sizes that hit every tail, and independent
//    of the thread count;
//  - the optimizers: 300 steps of an MLP next to the fp32 optimizers (Adam8bit / AdamW8bit
//    within 8%; LAMB8bit where Lamb with 8-bit-rounded moments lands), the same bits whichever
//    kernel is forced; LAMB8bit's first step Lamb's to rounding; state bytes <= 0.27 x the fp32
//    Adam's; save / load exact (the next step identical); checkpoints from fp32 optimizers;
//    statistics as dequantized copies; input errors; the config's names and keys;
//  - through the Trainer: resume bit-exact via the universal checkpoint layout (and an fp32
//    AdamW resuming from it), tiny BERT and GPT-2 eval losses next to fp32 AdamW's, and ZeRO
//    stage 2 at 2 ranks (partitions cut inside a parameter) tracking fp32 and resuming exactly.
// The 300-step BERT tiny / GPT-2 tiny comparison on the corpus is bench/optim_8bit.sh's.
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/optim/blockwise_quant.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/cpu_optim_8bit.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/optim/optimizers_8bit.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/zero/zero_backend.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/pattern_source.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace cpu_adam {
// Names the kernel in gtest's messages.
void PrintTo(Isa isa, std::ostream* os) { *os << isa_name(isa); }
}  // namespace cpu_adam

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using cpu_adam::Isa;
using quant8::DynamicCode;
using quant8::kBlockSize;

bool runs(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(cpu_adam::hardware_isa()); }

// ---- the codes ----------------------------------------------------------------------------------

/// The reference search: the index minimising |x - value| in exact arithmetic (double holds
/// the difference of two floats in this range exactly); an exact tie goes to the smaller |value|.
int brute_nearest(const DynamicCode& c, float x) {
  int best = 0;
  double best_d = INFINITY;
  for (int i = 0; i < 256; ++i) {
    const double d = std::fabs(static_cast<double>(x) - static_cast<double>(c.values[i]));
    if (d < best_d || (d == best_d && std::fabs(c.values[i]) < std::fabs(c.values[best]))) best = i, best_d = d;
  }
  return best;
}

TEST(DynamicCode, SignedTableByHand) {
  const DynamicCode& c = quant8::signed_code();
  for (int i = 0; i + 1 < 256; ++i) ASSERT_LT(c.values[i], c.values[i + 1]) << "sorted, distinct at " << i;
  EXPECT_EQ(c.zero_index, 127);
  EXPECT_EQ(c.values[127], 0.0f);
  EXPECT_EQ(c.values[255], 1.0f);
  // Decade 10^-E holds 2^(6-E) values (fraction bits 6 - E), at the midpoints of equal
  // intervals of [0.1, 1] times 10^-E:
  //   E = 6, 1 value:  1e-6 * (0.1 + 0.9 * 0.5 / 1)            = 5.5e-7
  //   E = 5, 2 values: 1e-5 * (0.1 + 0.9 * 0.5 / 2) = 1e-5 * 0.325 = 3.25e-6
  //                    1e-5 * (0.1 + 0.9 * 1.5 / 2) = 1e-5 * 0.775 = 7.75e-6
  //   E = 0, 64 values, the largest: 0.1 + 0.9 * 63.5 / 64 = 0.1 + 0.89296875 = 0.99296875
  //   and the value nearest 0.5: k = 28, 0.1 + 0.9 * 28.5 / 64 = 0.50078125
  EXPECT_FLOAT_EQ(c.values[128], 5.5e-7f);
  EXPECT_FLOAT_EQ(c.values[129], 3.25e-6f);
  EXPECT_FLOAT_EQ(c.values[130], 7.75e-6f);
  EXPECT_FLOAT_EQ(c.values[254], 0.99296875f);
  // 0 (index 127), then 1 + 2 + 4 + 8 + 16 + 32 = 63 values below the top decade: its k = 28
  // is magnitude 64 + 28 = 92, index 127 + 92 = 219.
  EXPECT_FLOAT_EQ(c.values[219], 0.50078125f);
  // The negatives mirror every positive value but 1.0: -1.0 is not in the code.
  for (int k = 1; k <= 127; ++k) EXPECT_EQ(c.values[127 - k], -c.values[127 + k]) << k;
  EXPECT_FLOAT_EQ(c.values[0], -0.99296875f);
  int per_decade[7] = {};
  for (float v : c.values)
    if (v > 0 && v < 1) ++per_decade[static_cast<int>(std::floor(-std::log10(v)))];  // decade 10^-E: [0.1, 1) * 10^-E
  for (int e = 0; e < 7; ++e) EXPECT_EQ(per_decade[e], 1 << (6 - e)) << "decade 1e-" << e;
}

TEST(DynamicCode, UnsignedTableByHand) {
  const DynamicCode& c = quant8::unsigned_code();
  for (int i = 0; i + 1 < 256; ++i) ASSERT_LT(c.values[i], c.values[i + 1]) << i;
  EXPECT_EQ(c.zero_index, 0);
  EXPECT_EQ(c.values[0], 0.0f);
  EXPECT_EQ(c.values[255], 1.0f);
  // The sign bit is one more fraction bit: 2^(7-E) values a decade.
  //   E = 6: 1e-6 * (0.1 + 0.9 * 0.5 / 2) = 3.25e-7,  1e-6 * (0.1 + 0.9 * 1.5 / 2) = 7.75e-7
  //   E = 0, the largest of 128: 0.1 + 0.9 * 127.5 / 128 = 0.996484375
  EXPECT_FLOAT_EQ(c.values[1], 3.25e-7f);
  EXPECT_FLOAT_EQ(c.values[2], 7.75e-7f);
  EXPECT_FLOAT_EQ(c.values[254], 0.996484375f);
  int per_decade[7] = {};
  for (float v : c.values)
    if (v > 0 && v < 1) ++per_decade[static_cast<int>(std::floor(-std::log10(v)))];
  for (int e = 0; e < 7; ++e) EXPECT_EQ(per_decade[e], 1 << (7 - e)) << "decade 1e-" << e;
}

// The table is what the kernels compute lane-wise (blockwise_quant.h: fma(slope[e], k, first[e]))
// and within 2 ulp of the formula evaluated exactly.
TEST(DynamicCode, ValuesAreTheFormulaInFloatWithin2UlpOfExact) {
  for (const DynamicCode* c : {&quant8::signed_code(), &quant8::unsigned_code()}) {
    const int shift = c->is_signed ? 0 : 1;
    for (int i = 0; i < 256; ++i) {
      EXPECT_EQ(quant8::code_value(*c, i), c->values[i]) << i;
      const int w = c->is_signed ? std::abs(i - 127) : i + 1;
      double exact = 0;
      if (w >= (1 << shift)) {
        int e = 0;
        while ((2 << e) <= w) ++e;
        const int k = w - (1 << e), decade = e - shift;  // 10^(decade - 6), 2^e values
        exact = decade == 7 ? 1.0 : std::pow(10.0, decade - 6) * (0.1 + 0.9 * (k + 0.5) / std::ldexp(1.0, e));
      }
      if (c->is_signed && i < 127) exact = -exact;
      const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(exact), 1e-30)) - 23);
      EXPECT_LE(std::fabs(c->values[i] - exact), 2 * ulp) << (c->is_signed ? "signed " : "unsigned ") << i;
    }
  }
}

TEST(DynamicCode, TableSearchIsTheBruteForceNearest) {
  for (const DynamicCode* c : {&quant8::signed_code(), &quant8::unsigned_code()}) {
    std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 1.5f, -1.5f, 1e-30f, -1e-30f, 2e-7f, -2e-7f};
    for (int i = 0; i < 256; ++i) {
      xs.push_back(c->values[i]);
      if (i == 255) break;
      // Around each midpoint: the midpoint's nearest floats and 3 ulps either side.
      float m = static_cast<float>((static_cast<double>(c->values[i]) + c->values[i + 1]) / 2);
      for (int k = 0; k < 3; ++k) m = std::nextafter(m, -2.0f);
      for (int k = 0; k < 7; ++k, m = std::nextafter(m, 2.0f)) xs.push_back(m);
    }
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < 100000; ++i)
      for (float scale : {1.0f, 1e-2f, 1e-4f, 1e-6f}) xs.push_back(u(rng) * scale);
    int bad = 0;
    for (float x : xs) {
      if (quant8::nearest_index(*c, x) != brute_nearest(*c, x) && ++bad <= 5)
        ADD_FAILURE() << (c->is_signed ? "signed" : "unsigned") << " x = " << x << ": table "
                      << int(quant8::nearest_index(*c, x)) << ", nearest " << brute_nearest(*c, x);
    }
    EXPECT_EQ(bad, 0) << "of " << xs.size();
  }
}

// The gather-free search (quant8::fast_magnitude, and the AVX-512 kernel's lanes) against the
// table search, for every float from 2^-26 (everything below rounds to 0 either way; a sample
// of those is checked too) to just above 1 (a value times its block's 1 / absmax): the fast
// search either agrees or says it is unsure (within kFastMargin of a midpoint), and it is
// unsure rarely. Every kernel's requantization (nearest_codes) gives the table's bytes, for
// the negatives of the signed code as well.
TEST(DynamicCode, FastSearchIsTheTableSearchForEveryFloatUpTo1) {
  auto bits = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof(b));
    return b;
  };
  auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  std::vector<Isa> isas = {Isa::kScalar};
  if (cpu_adam::hardware_isa() >= Isa::kAvx2) isas.push_back(Isa::kAvx2);
  if (cpu_adam::hardware_isa() >= Isa::kAvx512) isas.push_back(Isa::kAvx512);
  const uint32_t dense_from = bits(0x1p-26f), dense_to = bits(1.0f) + 4;  // inclusive
  for (const DynamicCode* c : {&quant8::signed_code(), &quant8::unsigned_code()}) {
    const char* name = c->is_signed ? "signed" : "unsigned";
    int64_t unsure = 0, wrong = 0, differ = 0;
    // One chunk of values at a time (bounded memory): every float of [2^-26, 1 + 4 ulp], the
    // tiny ones sampled, and for the signed code the negatives of every third.
    auto check = [&](std::vector<float>& xs, bool dense) {
      const size_t positives = xs.size();
      if (c->is_signed)
        for (size_t i = 0; i < positives; i += 3) xs.push_back(-xs[i]);
      std::vector<uint8_t> want(xs.size()), got(xs.size());
      for (size_t i = 0; i < xs.size(); ++i) {
        want[i] = quant8::nearest_index(*c, xs[i]);
        if (!dense || i >= positives) continue;
        const int m = quant8::fast_magnitude(*c, xs[i]);
        if (m < 0) ++unsure;
        else if (m != want[i] - c->zero_index && ++wrong <= 5)
          ADD_FAILURE() << name << " x = " << xs[i] << ": fast " << m << ", table " << want[i] - c->zero_index;
      }
      for (Isa isa : isas) {
        optim8bit::nearest_codes(*c, xs.data(), static_cast<int64_t>(xs.size()), got.data(), isa);
        for (size_t i = 0; i < xs.size(); ++i)
          if (got[i] != want[i] && ++differ <= 5)
            ADD_FAILURE() << name << ", " << cpu_adam::isa_name(isa) << " kernel, x = " << xs[i] << ": byte "
                          << int(got[i]) << ", table " << int(want[i]);
      }
    };
    std::vector<float> xs;
    for (uint32_t b = 0; b < dense_from; b += 4099) xs.push_back(from_bits(b));
    check(xs, false);
    for (uint64_t lo = dense_from; lo <= dense_to; lo += uint64_t{1} << 22) {
      xs.clear();
      for (uint64_t b = lo; b <= dense_to && b < lo + (uint64_t{1} << 22); ++b) xs.push_back(from_bits(static_cast<uint32_t>(b)));
      check(xs, true);
    }
    EXPECT_EQ(wrong, 0) << name;
    EXPECT_EQ(differ, 0) << name;
    const int64_t dense = int64_t{dense_to} - dense_from + 1;
    EXPECT_LT(unsure, dense / 1000) << name << ": unsure of " << unsure << " of " << dense << " floats";
  }
}

TEST(BlockwiseQuant, OneBlockByHand) {
  // absmax = 1: 0.5 -> 0.50078125 (index 219, above); -1.0 -> -0.99296875 (index 0, the most
  // negative value); 0.25 -> top decade k = 10: 0.1 + 0.9 * 10.5 / 64 = 0.24765625 (k = 11
  // would be 0.26171875), magnitude 64 + 10 = 74, index 201; 0 -> index 127.
  const float x[4] = {0.5f, -1.0f, 0.25f, 0.0f};
  uint8_t q[4];
  float absmax = -1, back[4];
  quant8::quantize_blockwise(quant8::signed_code(), x, 4, q, &absmax);
  EXPECT_EQ(absmax, 1.0f);
  EXPECT_EQ(std::vector<int>(q, q + 4), (std::vector<int>{219, 0, 201, 127}));
  quant8::dequantize_blockwise(quant8::signed_code(), q, &absmax, 4, back);
  const float want[4] = {0.50078125f, -0.99296875f, 0.24765625f, 0.0f};  // to the table's float rounding
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(back[i], want[i]) << i;
  // Scaled by 4: the same codes, absmax 4, values 4x.
  const float x4[4] = {2.0f, -4.0f, 1.0f, 0.0f};
  quant8::quantize_blockwise(quant8::signed_code(), x4, 4, q, &absmax);
  EXPECT_EQ(absmax, 4.0f);
  EXPECT_EQ(std::vector<int>(q, q + 4), (std::vector<int>{219, 0, 201, 127}));
  // Unsigned: 0.5 -> top decade of 128: k = (0.5 - 0.1) / 0.9 * 128 - 0.5 = 56.4 -> 56:
  // 0.1 + 0.9 * 56.5 / 128 = 0.497265625 (k = 57: 0.50429688); magnitude 2+4+...+64 = 126 values
  // below the top decade, so index 1 + 126 + 56 = 183.
  const float v[2] = {0.5f, 1.0f};
  quant8::quantize_blockwise(quant8::unsigned_code(), v, 2, q, &absmax);
  EXPECT_EQ(q[0], 183);
  EXPECT_EQ(q[1], 255);
  EXPECT_FLOAT_EQ(quant8::unsigned_code().values[183], 0.497265625f);
}

TEST(BlockwiseQuant, ThreeBlocksAgainstAPlainReferenceWithinTheErrorBound) {
  // The block of bitsandbytes' 8-bit optimizer states: 256 elements a scale (Optimizer2State.
  // init_state, blocksize = 256, since bitsandbytes 0.44; the paper and earlier releases: 2048).
  static_assert(kBlockSize == 256);
  // 2 full blocks and a partial one of 113, values over several decades and both signs.
  const int64_t n = 2 * kBlockSize + 113;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i)
    x[i] = static_cast<float>(std::sin(0.37 * i) * std::pow(10.0, -static_cast<double>(i % 7)) * (1 + (i / kBlockSize)));
  x[100] = -3.0f;  // block 0's absmax is negative: it maps to -0.99296875
  for (const DynamicCode* c : {&quant8::signed_code(), &quant8::unsigned_code()}) {
    std::vector<float> in = x;
    if (!c->is_signed)
      for (float& f : in) f = std::fabs(f);
    std::vector<uint8_t> q(n);
    std::vector<float> absmax(quant8::num_blocks(n)), back(n);
    quant8::quantize_blockwise(*c, in.data(), n, q.data(), absmax.data());
    quant8::dequantize_blockwise(*c, q.data(), absmax.data(), n, back.data());
    ASSERT_EQ(absmax.size(), 3u);
    // The largest gap between neighbouring values is in the top decade (0.9 / 64 signed,
    // 0.9 / 128 unsigned); half of it bounds the error, and -1 -> -0.99296875 costs 0.00703125;
    // plus the code values' own rounding to float (an ulp of 1: 2^-23).
    const double bound = (c->is_signed ? 0.00703125 : 0.9 / 256) + std::ldexp(1.0, -23);
    for (int64_t b = 0; b < 3; ++b) {
      const int64_t lo = b * kBlockSize, hi = std::min(n, lo + kBlockSize);
      float amax = 0;
      for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(in[i]));
      EXPECT_EQ(absmax[b], amax) << "block " << b;
      const float inv = 1.0f / amax;
      double worst = 0;
      for (int64_t i = lo; i < hi; ++i) {
        ASSERT_EQ(q[i], brute_nearest(*c, in[i] * inv)) << "element " << i;
        ASSERT_EQ(back[i], c->values[q[i]] * amax) << "element " << i;
        worst = std::max(worst, std::fabs(static_cast<double>(back[i]) - in[i]) / amax);
      }
      std::printf("[8bit] %s block %lld: max |x - dequant(quant(x))| / absmax = %.6f (bound %.6f)\n",
                  c->is_signed ? "signed" : "unsigned", static_cast<long long>(b), worst, bound);
      EXPECT_LE(worst, bound) << "block " << b;
    }
  }
}

// ---- the kernels --------------------------------------------------------------------------------

/// A flat parameter with 8-bit state, and what the tests need of it.
struct Flat8 {
  at::Tensor p;
  QuantizedMoments q;
  Flat8(const at::Tensor& init, const at::Tensor& m0, const at::Tensor& v0) : p(init.clone()), q(QuantizedMoments::zeros(init.numel())) {
    q.assign("exp_avg", m0);
    q.assign("exp_avg_sq", v0);
  }
  bool same_bits(const Flat8& o) const {
    return torch::equal(p, o.p) && torch::equal(q.exp_avg, o.q.exp_avg) && torch::equal(q.exp_avg_sq, o.q.exp_avg_sq) &&
           torch::equal(q.exp_avg_absmax, o.q.exp_avg_absmax) && torch::equal(q.exp_avg_sq_absmax, o.q.exp_avg_sq_absmax);
  }
};

Flat8 random_flat(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  return Flat8(torch::randn({n}), torch::randn({n}) * 1e-2, torch::rand({n}) * 1e-4);
}

const std::vector<int64_t> kSizes = {1, 15, 16, 17, 100, kBlockSize - 1, kBlockSize, kBlockSize + 1,
                                     2 * kBlockSize + 33, 2049, 70001};

class Kernel8bit : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!runs(GetParam())) GTEST_SKIP() << "this CPU (or OS) cannot run the " << cpu_adam::isa_name(GetParam()) << " kernel";
  }
};

// The definition: dequantize, cpu_adam's update in fp32, requantize. The moments (so the codes
// and scales) bit for bit where the CPU has FMA (cpu_adam's AVX kernels fuse the same
// multiply-adds); the parameters within float rounding (one division where cpu_adam has two).
TEST_P(Kernel8bit, AdamIsCpuAdamOnTheDequantizedStateThenRequantized) {
  const Isa fp32_isa = cpu_adam::hardware_isa();
  for (int64_t n : kSizes) {
    for (bool adamw : {true, false}) {
      SCOPED_TRACE("n " + std::to_string(n) + (adamw ? " AdamW" : " Adam"));
      Flat8 f = random_flat(n, 3);
      cpu_adam::Hyper h;
      h.lr = 1e-2f;
      h.weight_decay = 0.1f;
      h.adam_w_mode = adamw;
      at::Tensor p = f.p.clone(), m = f.q.dequantized("exp_avg"), v = f.q.dequantized("exp_avg_sq");
      const at::Tensor g = torch::randn({n});
      cpu_adam::step(h, 7, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                     cpu_adam::CopyOut::kNone, nullptr, fp32_isa);
      QuantizedMoments want = QuantizedMoments::zeros(n);
      want.assign("exp_avg", m);
      want.assign("exp_avg_sq", v);
      optim8bit::adam_step(h, 7, f.p.data_ptr<float>(), g.data_ptr<float>(), f.q.view(), n, GetParam());
      // Within 2 ulp of the largest weight, relative to it.
      EXPECT_LE((f.p - p).abs().max().item<float>(), 2 * std::ldexp(1.0f, -23) * p.abs().max().item<float>());
      if (fp32_isa == Isa::kScalar) continue;  // cpu_adam's scalar kernel does not fuse: moments close, not equal
      EXPECT_TRUE(torch::equal(f.q.exp_avg, want.exp_avg));
      EXPECT_TRUE(torch::equal(f.q.exp_avg_sq, want.exp_avg_sq));
      EXPECT_TRUE(torch::equal(f.q.exp_avg_absmax, want.exp_avg_absmax));
      EXPECT_TRUE(torch::equal(f.q.exp_avg_sq_absmax, want.exp_avg_sq_absmax));
    }
  }
}

// Every kernel against the scalar one, three steps of Adam (L2), AdamW and LAMB.
TEST_P(Kernel8bit, BitIdenticalToTheScalarKernel) {
  for (int64_t n : kSizes) {
    for (int mode = 0; mode < 4; ++mode) {  // Adam L2, AdamW, AdamW without bias correction, LAMB
      SCOPED_TRACE("n " + std::to_string(n) + " mode " + std::to_string(mode));
      Flat8 a = random_flat(n, 5), b = random_flat(n, 5);
      std::vector<float> sa(2 * quant8::num_blocks(n)), sb(sa.size());
      for (int t = 1; t <= 3; ++t) {
        const at::Tensor g = torch::randn({n}) * 0.1;
        if (mode < 3) {
          cpu_adam::Hyper h;
          h.lr = 1e-3f;
          h.weight_decay = 0.01f;
          h.adam_w_mode = mode != 0;
          h.bias_correction = mode != 2;
          optim8bit::adam_step(h, t, a.p.data_ptr<float>(), g.data_ptr<float>(), a.q.view(), n, Isa::kScalar);
          optim8bit::adam_step(h, t, b.p.data_ptr<float>(), g.data_ptr<float>(), b.q.view(), n, GetParam());
        } else {
          optim8bit::LambHyper h;
          h.weight_decay = 0.01;
          const double ta = optim8bit::lamb_step(h, t, a.p.data_ptr<float>(), g.data_ptr<float>(), a.q.view(), n,
                                                 sa.data(), Isa::kScalar);
          const double tb = optim8bit::lamb_step(h, t, b.p.data_ptr<float>(), g.data_ptr<float>(), b.q.view(), n,
                                                 sb.data(), GetParam());
          EXPECT_EQ(ta, tb) << "trust ratio";
        }
      }
      EXPECT_TRUE(a.same_bits(b));
    }
  }
}

TEST_P(Kernel8bit, ThreadCountDoesNotChangeBits) {
  const int saved = at::get_num_threads();
  const int64_t n = 300007;  // 1172 blocks, the last partial
  std::vector<Flat8> runs_;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    Flat8 f = random_flat(n, 9);
    std::vector<float> scratch(2 * quant8::num_blocks(n));
    for (int t = 1; t <= 2; ++t) {
      const at::Tensor g = torch::randn({n}) * 0.1;
      cpu_adam::Hyper h;
      optim8bit::adam_step(h, t, f.p.data_ptr<float>(), g.data_ptr<float>(), f.q.view(), n, GetParam());
      optim8bit::lamb_step(optim8bit::LambHyper{}, t, f.p.data_ptr<float>(), g.data_ptr<float>(), f.q.view(), n,
                           scratch.data(), GetParam());
    }
    runs_.push_back(std::move(f));
  }
  at::set_num_threads(saved);
  EXPECT_TRUE(runs_[0].same_bits(runs_[1]));
  EXPECT_TRUE(runs_[0].same_bits(runs_[2]));
}

INSTANTIATE_TEST_SUITE_P(Kernels, Kernel8bit, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& i) { return std::string(cpu_adam::isa_name(i.param)); });

// ---- the optimizers -----------------------------------------------------------------------------

NamedParams mlp_params(uint64_t seed) {
  torch::manual_seed(seed);
  // 12,577 elements: w1 12 blocks, w2 36 blocks, and parameters below one block (b1, b2: 96).
  return {{"w1", (torch::randn({32, 96}) * 0.2).requires_grad_()},
          {"b1", torch::zeros({96}).requires_grad_()},
          {"w2", (torch::randn({96, 96}) * 0.1).requires_grad_()},
          {"b2", torch::zeros({96}).requires_grad_()},
          {"w3", (torch::randn({96, 1}) * 0.1).requires_grad_()},
          {"b3", torch::zeros({1}).requires_grad_()}};
}

at::Tensor mlp_loss(const NamedParams& p, const at::Tensor& x, const at::Tensor& y) {
  auto h = torch::tanh(torch::matmul(x, p[0].second) + p[1].second);
  h = torch::tanh(torch::matmul(h, p[2].second) + p[3].second);
  return (torch::matmul(h, p[4].second) + p[5].second - y).pow(2).mean();
}

// A smaller network of the same form as teacher, plus noise (loss floor 0.01); 4096 samples to
// train on and 4096 held out (so the student learns the teacher rather than the noise).
struct Regression {
  at::Tensor x, y, x_test, y_test;
  Regression() {
    torch::manual_seed(21);
    const auto t1 = torch::randn({32, 8}) * 0.3, t2 = torch::randn({8, 1});
    auto make = [&](at::Tensor& xs, at::Tensor& ys) {
      xs = torch::randn({4096, 32});
      ys = torch::matmul(torch::tanh(torch::matmul(xs, t1)), t2) + 0.1 * torch::randn({4096, 1});
    };
    make(x, y);
    make(x_test, y_test);
  }
};

OptimizerConfig config_of(const std::string& type, double lr) {
  OptimizerConfig cfg;
  cfg.type = type;
  cfg.lr = lr;
  cfg.weight_decay = 0.01;
  cfg.no_decay = {"b"};
  // Every parameter 8-bit (these tests are about the 8-bit state; the 32-bit rules have their own).
  cfg.min_8bit_size = 0;
  cfg.keep_32bit_state = {};
  if (type == "Adam" || type == "Adam8bit") cfg.adam_w_mode = false;  // classic Adam: L2 decay
  if (type == "Lamb" || type == "LAMB8bit") cfg.eps = 1e-6;            // torch_optimizer's LAMB default
  return cfg;
}

struct MlpRun {
  std::vector<double> losses;  ///< training loss before each step
  double held_out = 0;         ///< after the last step
  NamedParams params;
};

/// `steps` full-batch steps of `type`. quantize_state: after each step, pass the optimizer's
/// moments through the 8-bit code (statistic -> quantize -> dequantize -> set_statistic): what
/// an 8-bit optimizer keeps, with the fp32 optimizer's arithmetic.
MlpRun train_mlp(const std::string& type, double lr, int steps, bool quantize_state = false) {
  const Regression data;
  MlpRun r;
  r.params = mlp_params(4);
  OptimizerConfig cfg = config_of(type, lr);
  auto opt = make_optimizer(cfg, split_by_decay(cfg, r.params));
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    auto loss = mlp_loss(r.params, data.x, data.y);
    loss.backward();
    opt->step();
    r.losses.push_back(loss.item<double>());
    for (const auto& [n, p] : r.params)
      for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
        if (!quantize_state) continue;
        QuantizedMoments q = QuantizedMoments::zeros(p.numel());
        q.assign(stat, opt->statistic(p, stat));
        opt->set_statistic(p, stat, q.dequantized(stat).view(p.sizes()));
      }
  }
  torch::NoGradGuard no_grad;
  r.losses.push_back(mlp_loss(r.params, data.x, data.y).item<double>());
  r.held_out = mlp_loss(r.params, data.x_test, data.y_test).item<double>();
  return r;
}

/// POLYTRAIN_CPU_ADAM_ISA set for a scope (the kernels' test hook), restored after.
struct ForcedIsa {
  explicit ForcedIsa(const char* isa) { setenv("POLYTRAIN_CPU_ADAM_ISA", isa, 1); }
  ~ForcedIsa() { unsetenv("POLYTRAIN_CPU_ADAM_ISA"); }
};

double rel(double got, double want) { return (got - want) / want; }

// 300 steps at lr 3e-3: Adam8bit and AdamW8bit end within 8% of the fp32 optimizer's training
// and held-out loss (measured, blocks of 256: 5.5-6.7% lower than fp32's; with blocks of 2048
// they were 1-5% off). LAMB8bit trails Lamb here (measured +13%): it follows
// Lamb whose moments are rounded to the 8-bit code after every step (within 2%), i.e. the gap
// is the 8-bit state's, not the kernel's (elements whose exp_avg_sq rounds to 0 in a block
// make outliers in the update u, which shrink the layer's trust ratio ||w|| / ||u||).
TEST(Optimizer8bit, TracksFp32OptimizersOnAnMlp) {
  at::set_num_threads(1);
  struct Case {
    const char* fp32;
    const char* q8;
    double tolerance;
  };
  for (const Case& c : {Case{"Adam", "Adam8bit", 0.08}, Case{"AdamW", "AdamW8bit", 0.08}, Case{"Lamb", "LAMB8bit", 0.25}}) {
    SCOPED_TRACE(c.q8);
    const int steps = 300;
    const MlpRun ref = train_mlp(c.fp32, 3e-3, steps), q = train_mlp(c.q8, 3e-3, steps);
    std::printf("[8bit] MLP, %d steps: %s train loss %.3f -> %.5f, held out %.5f; %s %.5f (%+.2f%%), held out %.5f "
                "(%+.2f%%)\n",
                steps, c.fp32, ref.losses.front(), ref.losses.back(), ref.held_out, c.q8, q.losses.back(),
                100 * rel(q.losses.back(), ref.losses.back()), q.held_out, 100 * rel(q.held_out, ref.held_out));
    EXPECT_LT(ref.losses.back(), ref.losses.front() / 5) << "the problem is learnt";
    EXPECT_LT(std::fabs(rel(q.losses.back(), ref.losses.back())), c.tolerance);
    EXPECT_LT(std::fabs(rel(q.held_out, ref.held_out)), c.tolerance);
    if (std::string(c.q8) == "LAMB8bit") {
      const MlpRun emulated = train_mlp(c.fp32, 3e-3, steps, /*quantize_state=*/true);
      std::printf("[8bit] MLP: Lamb with its state rounded to the 8-bit code each step %.5f (LAMB8bit %+.2f%%)\n",
                  emulated.losses.back(), 100 * rel(q.losses.back(), emulated.losses.back()));
      EXPECT_LT(std::fabs(rel(q.losses.back(), emulated.losses.back())), 0.02);
    }
  }
}

// The kernel the CPU runs is chosen at run time; forcing each one (the test hook) gives the same
// bits, every loss and every parameter.
TEST(Optimizer8bit, EveryKernelGivesTheSameBits) {
  at::set_num_threads(1);
  for (const char* type : {"Adam8bit", "AdamW8bit", "LAMB8bit"}) {
    SCOPED_TRACE(type);
    std::vector<MlpRun> runs;
    for (const char* isa : {"scalar", "avx2", "avx512"}) {
      ForcedIsa forced(isa);  // lowered to what the CPU has
      runs.push_back(train_mlp(type, 3e-3, 40));
    }
    for (size_t k = 1; k < runs.size(); ++k) {
      EXPECT_EQ(runs[k].losses, runs[0].losses) << "kernel " << k;
      for (size_t i = 0; i < runs[0].params.size(); ++i)
        EXPECT_TRUE(torch::equal(runs[k].params[i].second, runs[0].params[i].second)) << runs[0].params[i].first;
    }
  }
}

TEST(Optimizer8bit, StateIsAQuarterOfFp32Adam) {
  // bert_tiny.json's model (vocab 30522, hidden 128, 2 layers: 4.4M parameters).
  Config cfg;
  cfg.model.vocab_size = 30522;
  cfg.model.hidden_size = 128;
  cfg.model.num_hidden_layers = 2;
  cfg.model.num_attention_heads = 2;
  cfg.model.intermediate_size = 512;
  BertForMaskedLM model(cfg.model);
  NamedParams named;
  int64_t numel = 0;
  for (const auto& p : model->named_parameters()) {
    named.emplace_back(p.key(), p.value());
    p.value().mutable_grad() = torch::full_like(p.value(), 1e-3);
    numel += p.value().numel();
  }
  auto bytes_after_a_step = [&](const std::string& type) {
    OptimizerConfig o = config_of(type, 1e-3);
    auto opt = make_optimizer(o, split_by_decay(o, named));
    opt->step();
    return opt->state_bytes();
  };
  const int64_t fp32 = bytes_after_a_step("CPUAdam");
  EXPECT_EQ(fp32, 8 * numel) << "two fp32 moments";
  EXPECT_EQ(bytes_after_a_step("AdamW") , fp32) << "libtorch's AdamW keeps the same";
  for (const char* type : {"Adam8bit", "AdamW8bit", "LAMB8bit"}) {
    const int64_t q8 = bytes_after_a_step(type);
    std::printf("[8bit] %s: %lld state bytes for %lld parameters (%.4f bytes each), %.4f x CPUAdam's %lld\n", type,
                static_cast<long long>(q8), static_cast<long long>(numel), double(q8) / numel, double(q8) / fp32,
                static_cast<long long>(fp32));
    EXPECT_LE(q8, 0.27 * fp32) << type;
  }
  // With the default rules the word, position and token-type embeddings (4.0M of the 4.4M)
  // keep 32-bit state, as bitsandbytes' StableEmbedding does.
  OptimizerConfig o = config_of("AdamW8bit", 1e-3);
  o.min_8bit_size = OptimizerConfig().min_8bit_size;
  o.keep_32bit_state = OptimizerConfig().keep_32bit_state;
  auto opt = make_optimizer(o, split_by_decay(o, named));
  opt->step();
  std::printf("[8bit] AdamW8bit, default 32-bit rules: %.4f x CPUAdam's state\n", double(opt->state_bytes()) / fp32);
  EXPECT_GT(opt->state_bytes(), 0.8 * fp32);
}

/// An archive's bytes, for a save -> load round trip.
std::string archive_bytes(const Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream os;
  out.save_to(os);
  return os.str();
}

void load_bytes(Optimizer& opt, const std::string& bytes) {
  torch::serialize::InputArchive in;
  std::istringstream is(bytes);
  in.load_from(is);
  opt.load(in, "test");
}

NamedParams clone_params(const NamedParams& ps) {
  NamedParams out;
  for (const auto& [n, p] : ps) out.emplace_back(n, p.detach().clone().requires_grad_());
  return out;
}

void random_grads(const NamedParams& ps, uint64_t seed) {
  torch::manual_seed(seed);
  for (const auto& [n, p] : ps) p.mutable_grad() = torch::randn_like(p) * 0.1;
}

TEST(Optimizer8bit, SaveLoadIsExactAndTheNextStepIdentical) {
  for (const char* type : {"AdamW8bit", "Adam8bit", "LAMB8bit"}) {
    SCOPED_TRACE(type);
    const OptimizerConfig cfg = config_of(type, 1e-2);
    NamedParams a = mlp_params(1);
    auto opt_a = make_optimizer(cfg, split_by_decay(cfg, a));
    for (int s = 0; s < 5; ++s) {
      random_grads(a, 100 + s);
      opt_a->step();
    }
    const std::string saved = archive_bytes(*opt_a);
    NamedParams b = clone_params(a);
    auto opt_b = make_optimizer(cfg, split_by_decay(cfg, b));
    load_bytes(*opt_b, saved);
    EXPECT_EQ(archive_bytes(*opt_b), saved) << "codes, scales and steps restored exactly";
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* stat : {"exp_avg", "exp_avg_sq"})
        EXPECT_TRUE(torch::equal(opt_a->statistic(a[i].second, stat), opt_b->statistic(b[i].second, stat)));
    for (int s = 0; s < 3; ++s) {
      random_grads(a, 200 + s);
      random_grads(b, 200 + s);
      opt_a->step();
      opt_b->step();
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    EXPECT_EQ(archive_bytes(*opt_a), archive_bytes(*opt_b));
  }
}

// bitsandbytes' rules: a parameter under min_8bit_size elements, or named by keep_32bit_state
// (the embeddings by default), keeps fp32 moments and takes the fp32 optimizer's exact update:
// CPU Adam's kernel for Adam8bit / AdamW8bit, polytrain::Lamb's for LAMB8bit. The others are
// 8-bit. Checkpoints hold fp32 moments for the first, codes for the second, and load both ways.
TEST(Optimizer8bit, SmallAndEmbeddingParametersKeep32BitStateAsBitsandbytes) {
  at::set_num_threads(1);
  torch::manual_seed(3);
  const NamedParams init = {{"encoder.embed.weight", torch::randn({300, 16})},  // 4800: named
                            {"encoder.w", torch::randn({80, 64}) * 0.1},      // 5120: 8-bit
                            {"encoder.b", torch::randn({64}) * 0.1}};         // 64: small
  for (const char* type : {"AdamW8bit", "Adam8bit", "LAMB8bit"}) {
    SCOPED_TRACE(type);
    const bool lamb = std::string(type) == "LAMB8bit";
    OptimizerConfig c8 = config_of(type, 1e-2);
    c8.min_8bit_size = 4096;
    c8.keep_32bit_state = {"embed"};
    OptimizerConfig c32 = config_of(lamb ? "Lamb" : "CPUAdam", 1e-2);
    c32.adam_w_mode = c8.adam_w_mode || std::string(type) == "AdamW8bit";
    NamedParams a = clone_params(init), b = clone_params(init);
    auto o8 = make_optimizer(c8, split_by_decay(c8, a));
    auto o32 = make_optimizer(c32, split_by_decay(c32, b));
    for (int s = 0; s < 4; ++s) {
      random_grads(a, 300 + s);
      random_grads(b, 300 + s);
      o8->step();
      o32->step();
    }
    for (int i : {0, 2}) {
      EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first << ": the fp32 optimizer's update";
      for (const char* stat : {"exp_avg", "exp_avg_sq"})
        EXPECT_TRUE(torch::equal(o8->statistic(a[i].second, stat), o32->statistic(b[i].second, stat))) << stat;
    }
    EXPECT_FALSE(torch::equal(a[1].second, b[1].second)) << "encoder.w is 8-bit";
    EXPECT_LT((a[1].second - b[1].second).abs().max().item<double>(), 0.05);
    const int64_t want = 8 * (4800 + 64) + 2 * 5120 + 4 * 2 * quant8::num_blocks(5120) +
                         (lamb ? 4 * 2 * quant8::num_blocks(5120) : 0);  // LAMB's norms scratch
    EXPECT_EQ(o8->state_bytes(), want);

    // Save -> load is exact; a CPUAdam / Lamb checkpoint gives the 32-bit slots their moments
    // exactly and the 8-bit one its moments quantized.
    const std::string saved = archive_bytes(*o8);
    NamedParams c = clone_params(a);
    auto o8b = make_optimizer(c8, split_by_decay(c8, c));
    load_bytes(*o8b, saved);
    EXPECT_EQ(archive_bytes(*o8b), saved);
    auto o8c = make_optimizer(c8, split_by_decay(c8, c));
    load_bytes(*o8c, archive_bytes(*o32));
    for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
      EXPECT_TRUE(torch::equal(o8c->statistic(c[0].second, stat), o32->statistic(b[0].second, stat)));
      QuantizedMoments q = QuantizedMoments::zeros(5120);
      q.assign(stat, o32->statistic(b[1].second, stat));
      EXPECT_TRUE(torch::equal(o8c->statistic(c[1].second, stat), q.dequantized(stat).view({80, 64})));
    }
    // All 8-bit: an 8-bit checkpoint's 32-bit slots are quantized on load, and the other way round.
    OptimizerConfig all8 = c8;
    all8.min_8bit_size = 0;
    all8.keep_32bit_state = {};
    auto o8d = make_optimizer(all8, split_by_decay(all8, c));
    load_bytes(*o8d, saved);
    EXPECT_EQ(o8d->state_bytes(), 2 * (4800 + 5120 + 64) + 4 * 2 * (quant8::num_blocks(4800) + quant8::num_blocks(5120) + 1) +
                                      (lamb ? 4 * 2 * quant8::num_blocks(5120) : 0));
    auto o8e = make_optimizer(c8, split_by_decay(c8, c));
    load_bytes(*o8e, archive_bytes(*o8d));
    EXPECT_EQ(o8e->state_bytes(), want);
    // set_statistic on a 32-bit slot writes its moments.
    o8->set_statistic(a[2].second, "exp_avg", torch::full({64}, 0.5f));
    EXPECT_TRUE(torch::equal(o8->statistic(a[2].second, "exp_avg"), torch::full({64}, 0.5f)));
  }
}

// From zero moments the first step sees no quantization (it only acts on the stored state):
// LAMB8bit's first update is polytrain's Lamb's to float rounding; later ones differ by the
// state's quantization.
TEST(Optimizer8bit, LambFirstStepIsLambsAndLaterOnesStayClose) {
  for (bool debias : {true, false}) {
    SCOPED_TRACE(debias ? "debias" : "no debias");
    OptimizerConfig c32 = config_of("Lamb", 1e-2), c8 = config_of("LAMB8bit", 1e-2);
    c32.bias_correction = c8.bias_correction = debias;
    NamedParams a = mlp_params(1), b = clone_params(a);
    auto o32 = make_optimizer(c32, split_by_decay(c32, a));
    auto o8 = make_optimizer(c8, split_by_decay(c8, b));
    for (int s = 1; s <= 20; ++s) {
      random_grads(a, 500 + s);
      random_grads(b, 500 + s);
      o32->step();
      o8->step();
      double worst = 0, ulps = 0;  // the largest difference relative to the parameter's largest move so far
      for (size_t i = 0; i < a.size(); ++i) {
        const at::Tensor start = mlp_params(1)[i].second.detach();
        const double moved = (a[i].second - start).abs().max().item<double>();
        const double diff = (a[i].second - b[i].second).abs().max().item<double>();
        worst = std::max(worst, diff / moved);
        ulps = std::max(ulps, diff / (std::ldexp(1.0, -23) * a[i].second.abs().max().item<double>()));
      }
      if (s == 1) EXPECT_LE(ulps, 2.0) << "step 1: float rounding only (in ulps of the largest weight)";
      if (s == 1 || s == 20)
        std::printf("[8bit] LAMB8bit vs Lamb, step %d: max |difference| = %.3g x the largest move, %.2f ulp\n", s,
                    worst, ulps);
      EXPECT_LT(worst, 0.05) << "step " << s;
    }
  }
}

TEST(Optimizer8bit, CheckpointsFromFp32OptimizersAreQuantized) {
  for (const char* fp32 : {"CPUAdam", "AdamW", "Lamb"}) {
    SCOPED_TRACE(fp32);
    const OptimizerConfig cfg32 = config_of(fp32, 1e-2);
    NamedParams a = mlp_params(1);
    auto opt32 = make_optimizer(cfg32, split_by_decay(cfg32, a));
    for (int s = 0; s < 4; ++s) {
      random_grads(a, 300 + s);
      opt32->step();
    }
    const OptimizerConfig cfg8 = config_of(std::string(fp32) == "Lamb" ? "LAMB8bit" : "AdamW8bit", 1e-2);
    auto opt8 = make_optimizer(cfg8, split_by_decay(cfg8, a));
    load_bytes(*opt8, archive_bytes(*opt32));
    for (const auto& [n, p] : a)
      for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
        const at::Tensor want = opt32->statistic(p, stat), got = opt8->statistic(p, stat);
        ASSERT_TRUE(got.defined()) << n;
        // Within the code's error bound relative to the parameter's largest magnitude (a block's
        // absmax is at most that).
        EXPECT_LE((got - want).abs().max().item<float>(), 0.0071f * want.abs().max().item<float>() + 1e-30f)
            << n << " " << stat;
      }
  }
  // AMSGrad's state has no place here.
  OptimizerConfig ams = config_of("AdamW", 1e-2);
  ams.amsgrad = true;
  NamedParams a = mlp_params(1);
  auto opt_ams = make_optimizer(ams, split_by_decay(ams, a));
  random_grads(a, 1);
  opt_ams->step();
  const OptimizerConfig cfg8 = config_of("AdamW8bit", 1e-2);
  auto opt8 = make_optimizer(cfg8, split_by_decay(cfg8, a));
  EXPECT_THROW(load_bytes(*opt8, archive_bytes(*opt_ams)), InputError);
}

TEST(Optimizer8bit, StatisticsAreDequantizedCopiesAndSetStatisticRequantizes) {
  const OptimizerConfig cfg = config_of("AdamW8bit", 1e-2);
  NamedParams a = mlp_params(1);
  auto opt = make_optimizer(cfg, split_by_decay(cfg, a));
  EXPECT_EQ(optimizer_statistics(cfg), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  const at::Tensor& w = a[0].second;
  EXPECT_FALSE(opt->statistic(w, "exp_avg").defined()) << "before the first update";
  random_grads(a, 1);
  opt->step();
  at::Tensor m = opt->statistic(w, "exp_avg");
  ASSERT_TRUE(m.defined());
  EXPECT_EQ(m.sizes(), w.sizes());
  EXPECT_EQ(m.scalar_type(), at::kFloat);
  const at::Tensor before = m.clone();
  m.fill_(7.0f);
  EXPECT_TRUE(torch::equal(opt->statistic(w, "exp_avg"), before)) << "a copy: writing it changes nothing";
  opt->set_statistic(w, "exp_avg", torch::full_like(w, 0.5f));
  EXPECT_TRUE(torch::equal(opt->statistic(w, "exp_avg"), torch::full_like(w, 0.5f))) << "0.5 / absmax 0.5 is code 1.0";
  opt->set_statistic(w, "exp_avg_sq", before.abs());  // a swarm's average: requantized
  EXPECT_LE((opt->statistic(w, "exp_avg_sq") - before.abs()).abs().max().item<float>(),
            0.0036f * before.abs().max().item<float>());
  EXPECT_THROW(opt->statistic(w, "momentum_buffer"), InputError);
  EXPECT_THROW(opt->set_statistic(w, "max_exp_avg_sq", before), InputError);
}

std::string input_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

TEST(Optimizer8bit, BadValuesAndParametersAreInputErrorsNamingTheKey) {
  NamedParams a = mlp_params(1);
  for (const char* type : {"Adam8bit", "AdamW8bit", "LAMB8bit"}) {
    SCOPED_TRACE(type);
    auto bad = [&](auto edit) {
      OptimizerConfig cfg = config_of(type, 1e-3);
      edit(cfg);
      return input_error_of([&] { make_optimizer(cfg, split_by_decay(cfg, a)); });
    };
    EXPECT_NE(bad([](OptimizerConfig& c) { c.lr = -1; }).find("optimizer.params.lr"), std::string::npos);
    EXPECT_NE(bad([](OptimizerConfig& c) { c.eps = -1e-8; }).find("optimizer.params.eps"), std::string::npos);
    EXPECT_NE(bad([](OptimizerConfig& c) { c.beta1 = 1.0; }).find("optimizer.params.betas[0]"), std::string::npos);
    EXPECT_NE(bad([](OptimizerConfig& c) { c.beta2 = -0.1; }).find("optimizer.params.betas[1]"), std::string::npos);
    EXPECT_NE(bad([](OptimizerConfig& c) { c.weight_decay = -1; }).find("optimizer.params.weight_decay"),
              std::string::npos);
    EXPECT_NE(bad([](OptimizerConfig& c) { c.amsgrad = true; }).find("amsgrad"), std::string::npos);
    if (std::string(type) == "LAMB8bit")
      EXPECT_NE(bad([](OptimizerConfig& c) { c.clamp_value = -1; }).find("clamp_value"), std::string::npos);
    const OptimizerConfig cfg = config_of(type, 1e-3);
    for (const at::Tensor& t : {torch::zeros({4}, torch::kDouble), torch::zeros({4}, torch::kBFloat16)}) {
      const std::string e = input_error_of([&] { make_optimizer(cfg, {ParamGroup{{{"x", t.requires_grad_()}}, 0.0}}); });
      EXPECT_NE(e.find(std::string("optimizer.type ") + type), std::string::npos) << e;
      EXPECT_NE(e.find("fp32 CPU"), std::string::npos) << e;
    }
    const at::Tensor strided = torch::zeros({4, 4}).t().requires_grad_();
    EXPECT_NE(input_error_of([&] { make_optimizer(cfg, {ParamGroup{{{"x", strided}}, 0.0}}); }).find("contiguous"),
              std::string::npos);
    EXPECT_THROW(make_optimizer(cfg, split_by_decay(cfg, a))->torch_optimizer(), InternalError);
    auto opt = make_optimizer(cfg, split_by_decay(cfg, a));
    EXPECT_TRUE(opt->has_beta1());
    EXPECT_THROW(opt->set_beta1(1.5), InputError);
    a[0].second.mutable_grad() = torch::zeros({3});  // a gradient of the wrong shape
    EXPECT_THROW(opt->step(), InputError);
    a[0].second.mutable_grad() = at::Tensor();
  }
}

// A state saved with blocks of 2048 (earlier checkpoints): its scales' count tells, and the
// moments are dequantized with those blocks and requantized with kBlockSize ones; any other
// count is an InputError.
TEST(Optimizer8bit, StatesSavedWithBlocksOf2048AreRequantized) {
  const int64_t n = 5000;  // 3 blocks of 2048, 20 of 256
  torch::manual_seed(8);
  const at::Tensor m = torch::randn({n}) * torch::exp(torch::randn({n}) * 3), v = m * m;
  std::map<std::string, at::Tensor> saved;
  std::map<std::string, at::Tensor> want;
  for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
    const DynamicCode& c = std::string(stat) == "exp_avg" ? quant8::signed_code() : quant8::unsigned_code();
    const at::Tensor& x = std::string(stat) == "exp_avg" ? m : v;
    at::Tensor codes = torch::empty({n}, torch::kUInt8), absmax = torch::empty({quant8::num_blocks(n, 2048)});
    quant8::quantize_blockwise(c, x.data_ptr<float>(), n, codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), 2048);
    saved[std::string(stat) + "_codes"] = codes;
    saved[std::string(stat) + "_absmax"] = absmax;
    at::Tensor legacy = torch::empty({n});
    quant8::dequantize_blockwise(c, codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n, legacy.data_ptr<float>(),
                                 2048);
    QuantizedMoments q = QuantizedMoments::zeros(n);
    q.assign(stat, legacy);
    want[stat] = q.dequantized(stat);
  }
  ASSERT_EQ(saved["exp_avg_absmax"].numel(), 3);
  const auto got = optim8bit::dequantize_saved(saved, n, "test");
  for (const char* stat : {"exp_avg", "exp_avg_sq"}) EXPECT_TRUE(torch::equal(got.at(stat), want.at(stat))) << stat;
  saved["exp_avg_sq_absmax"] = torch::zeros({7});
  const std::string err = input_error_of([&] { optim8bit::dequantize_saved(saved, n, "test"); });
  EXPECT_NE(err.find("exp_avg_sq_absmax' has 7 block scales"), std::string::npos) << err;
}

TEST(Optimizer8bit, ConfigNamesAndKeys) {
  auto parse = [](const json& optimizer) {
    return config_from_json(json{{"train_batch_size", 8}, {"optimizer", optimizer}}, "c.json", 1);
  };
  EXPECT_EQ(parse({{"type", "adamw8bit"}}).optimizer.type, "AdamW8bit");
  EXPECT_TRUE(parse({{"type", "AdamW8bit"}, {"params", {{"adam_w_mode", false}}}}).optimizer.adam_w_mode)
      << "the name AdamW8bit forces decoupled decay";
  EXPECT_FALSE(parse({{"type", "Adam8bit"}, {"params", {{"adam_w_mode", false}}}}).optimizer.adam_w_mode);
  EXPECT_EQ(parse({{"type", "Lamb8bit"}}).optimizer.type, "LAMB8bit");
  const Config lamb = parse({{"type", "LAMB8bit"}, {"params", {{"debias", false}, {"clamp_value", 5.0}}}});
  EXPECT_FALSE(lamb.optimizer.bias_correction);
  EXPECT_EQ(lamb.optimizer.clamp_value, 5.0);
  auto error = [&](const json& optimizer) { return input_error_of([&] { parse(optimizer); }); };
  EXPECT_NE(error({{"type", "Adam8bit"}, {"params", {{"fused", true}}}}).find("fused"), std::string::npos);
  EXPECT_NE(error({{"type", "AdamW8bit"}, {"params", {{"amsgrad", true}}}}).find("amsgrad"), std::string::npos);
  EXPECT_NE(error({{"type", "LAMB8bit"}, {"params", {{"betas", {0.9, 1.0}}}}}).find("betas"), std::string::npos);
  EXPECT_NE(error({{"type", "Adam8bit"}, {"params", {{"lr", -1}}}}).find("lr"), std::string::npos);
  EXPECT_NE(error({{"type", "Adam4bit"}}).find("AdamW8bit"), std::string::npos) << "the known list names them";
  const Config rules = parse({{"type", "AdamW8bit"}, {"params", {{"min_8bit_size", 0}, {"keep_32bit_state", json::array()}}}});
  EXPECT_EQ(rules.optimizer.min_8bit_size, 0);
  EXPECT_TRUE(rules.optimizer.keep_32bit_state.empty());
  EXPECT_EQ(parse({{"type", "LAMB8bit"}}).optimizer.min_8bit_size, 4096) << "bitsandbytes' default";
  EXPECT_NE(error({{"type", "AdamW8bit"}, {"params", {{"min_8bit_size", -1}}}}).find("optimizer.params.min_8bit_size"),
            std::string::npos);
  EXPECT_NE(error({{"type", "AdamW"}, {"params", {{"min_8bit_size", 0}}}}).find("min_8bit_size"), std::string::npos)
      << "an 8-bit optimizer's key only";
}

// ---- through the Trainer -----------------------------------------------------------------------

using polytrain::testing::PatternSource;
using polytrain::testing::TempDir;
using polytrain::testing::tiny_config;

class BertTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    return dynamic_cast<BertForMaskedLMImpl&>(model).forward(batch.at("input_ids"), batch.at("attention_mask"),
                                                             batch.at("token_type_ids"), batch.at("labels"));
  }
};

struct TrainerRun {
  TrainResult result;
  double eval_loss = 0;
  std::vector<at::Tensor> params;
};

TrainerRun train_bert(const Config& cfg) {
  PatternSource train(256), eval(64);
  BertTrainer trainer(cfg);
  BertForMaskedLM model(cfg.model);
  TrainerRun r;
  r.result = trainer.train(model.ptr(), train);
  r.eval_loss = trainer.evaluate(*model, eval).loss;
  for (auto& p : model->parameters()) r.params.push_back(p.detach().clone());
  return r;
}

TEST(Trainer8bit, ResumeIsBitExactThroughTheUniversalLayoutAndAdamWResumesFromIt) {
  TempDir tmp;
  Config cfg = tiny_config(tmp.path);  // dropout on: the RNG state is restored too
  cfg.optimizer.type = "AdamW8bit";
  cfg.trainer.eval_interval = 0;
  const TrainerRun full = train_bert(cfg);

  Config first = cfg;
  first.trainer.max_steps = 4;
  first.trainer.save_dir = (tmp.path / "ckpt").string();
  train_bert(first);
  Config second = cfg;
  second.trainer.load_dir = first.trainer.save_dir;
  second.trainer.save_dir = (tmp.path / "ckpt2").string();
  const TrainerRun resumed = train_bert(second);
  ASSERT_EQ(resumed.result.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed.result.losses[i], full.result.losses[4 + i]) << "step " << 5 + i;
  ASSERT_EQ(full.params.size(), resumed.params.size());
  for (size_t i = 0; i < full.params.size(); ++i) EXPECT_TRUE(torch::equal(full.params[i], resumed.params[i])) << i;

  // The same checkpoint resumed by fp32 AdamW: its moments come dequantized.
  Config fp32 = second;
  fp32.optimizer.type = "AdamW";
  fp32.trainer.save_dir = (tmp.path / "ckpt3").string();
  const TrainerRun other = train_bert(fp32);
  ASSERT_EQ(other.result.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(other.result.losses[i], full.result.losses[4 + i], 0.05 * full.result.losses[4 + i]) << i;
}

// The short version of bench/optim_8bit.sh (BERT tiny and GPT-2 tiny, 300 steps on the corpus):
// the test suite's tiny models on synthetic data, 200 steps. The tiny BERT's pattern task is
// learnt in a sudden drop whose timing depends on the seed (fp32 AdamW's eval loss after 200
// steps spans 1.3-2.4 over seeds 42, 7, 99), so it is compared as the mean of three seeds,
// within 5%; the GPT-2 task converges smoothly: one seed, within 2%.
TEST(Trainer8bit, TinyBertEvalLossNextToFp32AdamW) {
  TempDir tmp;
  double fp32 = 0, q8 = 0, first = 0;
  for (int64_t seed : {42, 7, 99}) {
    Config cfg = tiny_config(tmp.path, 0.0);
    cfg.trainer.max_steps = 200;
    cfg.trainer.eval_interval = 0;
    cfg.trainer.seed = seed;
    const TrainerRun a = train_bert(cfg);
    cfg.optimizer.type = "AdamW8bit";
    const TrainerRun b = train_bert(cfg);
    std::printf("[8bit] tiny BERT, 200 steps, seed %lld: eval loss AdamW %.4f, AdamW8bit %.4f\n",
                static_cast<long long>(seed), a.eval_loss, b.eval_loss);
    fp32 += a.eval_loss / 3, q8 += b.eval_loss / 3, first += a.result.losses.front() / 3;
  }
  std::printf("[8bit] tiny BERT, mean of 3 seeds: AdamW %.4f, AdamW8bit %.4f, ratio %.4f (first train loss %.4f)\n",
              fp32, q8, q8 / fp32, first);
  EXPECT_LT(fp32, 0.6 * first) << "it learns";
  EXPECT_NEAR(q8 / fp32, 1.0, 0.05);
}

/// Sample i: a token sequence of period 3 (so the next token is predictable), labels = inputs.
class PeriodicSource : public BatchSource {
 public:
  explicit PeriodicSource(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t /*epoch*/) const override {
    const int64_t b = static_cast<int64_t>(indices.size()), len = 24;
    auto ids = torch::empty({b, len}, torch::kLong);
    for (int64_t r = 0; r < b; ++r)
      for (int64_t t = 0; t < len; ++t) ids[r][t] = 1 + (indices[r] * 7 + (t % 3) * (1 + indices[r] % 5)) % 60;
    Batch batch;
    batch.set("input_ids", ids);
    batch.set("labels", ids.clone());
    return batch;
  }

 private:
  int64_t n_;
};

class Gpt2Trainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    return dynamic_cast<Gpt2LMHeadModelImpl&>(model).forward(batch.at("input_ids"), {}, batch.at("labels"));
  }
};

double train_gpt2_eval(Config cfg, const std::string& type) {
  cfg.optimizer.type = type;
  Gpt2Config g;
  g.vocab_size = 64;
  g.n_positions = 32;
  g.n_embd = 32;
  g.n_layer = 2;
  g.n_head = 2;
  g.resid_pdrop = g.embd_pdrop = g.attn_pdrop = 0.0;
  PeriodicSource train(256), eval(64);
  Gpt2Trainer trainer(cfg);
  Gpt2LMHeadModel model(g);
  trainer.train(model.ptr(), train);
  return trainer.evaluate(*model, eval).loss;
}

TEST(Trainer8bit, TinyGpt2EvalLossNextToFp32AdamW) {
  TempDir tmp;
  Config cfg = tiny_config(tmp.path, 0.0);
  cfg.trainer.max_steps = 200;
  cfg.trainer.eval_interval = 0;
  const double fp32 = train_gpt2_eval(cfg, "AdamW"), q8 = train_gpt2_eval(cfg, "AdamW8bit");
  std::printf("[8bit] tiny GPT-2, 200 steps: eval loss AdamW %.5f, AdamW8bit %.5f, ratio %.4f (uniform: %.4f)\n", fp32,
              q8, q8 / fp32, std::log(64.0));
  EXPECT_LT(fp32, 0.5 * std::log(64.0)) << "it learns";
  EXPECT_NEAR(q8 / fp32, 1.0, 0.02);
}

// ---- ZeRO ----------------------------------------------------------------------------------------

// 5,130 trainable elements in two groups: at 2 ranks the weight group's partitions hold 2,560
// elements (rank 0: 10 blocks of lin1.weight; rank 1: its last 6 blocks, then lin2.weight), the
// bias group's far less (the padding after the biases an 8-bit run shorter than a block).
struct Net : torch::nn::Module {
  torch::nn::Linear lin1{nullptr}, lin2{nullptr};
  Net() {
    torch::manual_seed(7);
    lin1 = register_module("lin1", torch::nn::Linear(16, 256));
    lin2 = register_module("lin2", torch::nn::Linear(256, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return lin2(torch::tanh(lin1(x))); }
};

class WaveSource : public BatchSource {
 public:
  int64_t size() const override { return 192; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t /*epoch*/) const override {
    auto f = torch::tensor(indices, torch::kLong).to(torch::kDouble).unsqueeze(1);
    auto x = torch::cat({torch::sin(f * (torch::arange(16) * 0.13 + 0.2))}, 1).to(torch::kFloat);
    // A target the net can learn: a fixed smooth function of x (no random numbers involved).
    const auto w = torch::sin(torch::arange(64, torch::kFloat) * 0.9).view({16, 4});
    Batch b;
    b.set("x", x);
    b.set("y", torch::tanh(torch::matmul(x, w)));
    return b;
  }
};

class NetTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    ModelOutput out;
    out.loss = (dynamic_cast<Net&>(model).forward(batch.at("x")) - batch.at("y")).pow(2).mean();
    return out;
  }
};

Config zero_config(const fs::path& dir, const std::string& type, const std::string& env, int64_t steps, int world) {
  json doc = {{"train_batch_size", 16},
              {"optimizer", {{"type", type}, {"params", {{"lr", 0.01}, {"weight_decay", 0.01}}}}},
              {"trainer",
               {{"env_type", env},
                {"max_steps", steps},
                {"eval_interval", 0},
                {"log_interval", 100},
                {"save_interval", 0},
                {"progress_bar", false},
                {"comm_timeout", 30},
                {"seed", 5},
                {"num_threads", 1},
                {"experiments_dir", (dir / "exp").string()}}}};
  if (env == "deepspeed") doc["zero_optimization"] = {{"stage", 2}, {"reduce_bucket_size", 500}, {"overlap_comm", true}};
  return config_from_json(doc, "test", world);
}

/// Rank 0's losses of a run at `world` ranks (env_type deepspeed) or one process (pytorch).
std::vector<double> train_net(const fs::path& dir, const std::string& type, const std::string& env, int world,
                              int64_t steps, const std::string& save_dir = "", const std::string& load_dir = "") {
  const int port = polytrain::testing::free_port();
  const fs::path out = dir / ("losses_" + std::to_string(port) + ".json");
  auto status = polytrain::testing::run_ranks(world, std::chrono::seconds(120), [&](int rank) {
    Config cfg = zero_config(dir, type, env, steps, world);
    cfg.trainer.save_dir = save_dir.empty() ? (dir / "unused").string() : save_dir;
    cfg.trainer.load_dir = load_dir;
    NetTrainer trainer(cfg);
    if (env == "deepspeed")
      trainer.set_backend(std::make_unique<ZeroBackend>(
          cfg, make_gloo_communicator(rank, world, "127.0.0.1", port, std::chrono::seconds(30))));
    WaveSource data;
    const auto res = trainer.train(std::make_shared<Net>(), data);
    if (rank == 0) std::ofstream(out) << json(res.losses).dump();
    return 0;
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
  std::ifstream in(out);
  json j;
  in >> j;
  return j.get<std::vector<double>>();
}

TEST(Zero8bit, Stage2AtTwoRanksTracksFp32AndResumesExactly) {
  TempDir tmp;
  const auto fp32 = train_net(tmp.path, "AdamW", "pytorch", 1, 40);
  const auto q8 = train_net(tmp.path, "AdamW8bit", "deepspeed", 2, 40);
  EXPECT_LT(fp32.back(), 0.5 * fp32.front()) << "it learns";
  ASSERT_EQ(q8.size(), fp32.size());
  std::printf("[8bit] ZeRO-2 x2 AdamW8bit: loss %.5f -> %.5f; one-process fp32 AdamW %.5f -> %.5f\n", q8.front(),
              q8.back(), fp32.front(), fp32.back());
  std::fflush(stdout);  // before the next fork
  EXPECT_NEAR(q8.back(), fp32.back(), 0.05 * fp32.back());
  // 40 steps straight, or 25, a checkpoint, and 15 more: the same losses, bit for bit (the
  // partitions' codes and scales come back as saved).
  const auto first = train_net(tmp.path, "AdamW8bit", "deepspeed", 2, 25, (tmp.path / "ckpt").string());
  const auto rest = train_net(tmp.path, "AdamW8bit", "deepspeed", 2, 40, (tmp.path / "ckpt2").string(),
                              (tmp.path / "ckpt").string());
  ASSERT_EQ(rest.size(), 15u);
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i], q8[25 + i]) << "step " << 26 + i;
  // The same checkpoint at one rank (other partitions: the fp32 pieces requantized) goes on
  // close to the uninterrupted run.
  const auto one = train_net(tmp.path, "AdamW8bit", "deepspeed", 1, 40, (tmp.path / "ckpt3").string(),
                             (tmp.path / "ckpt").string());
  ASSERT_EQ(one.size(), 15u);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(one[i], q8[25 + i], 0.02 * q8[25 + i]) << "step " << 26 + i;
}

/// A one-rank Gloo communicator on a free port (a null one would take MASTER_PORT's default,
/// 29500, which another test may hold).
std::unique_ptr<Communicator> one_rank() {
  return make_gloo_communicator(0, 1, "127.0.0.1", polytrain::testing::free_port(), std::chrono::seconds(30));
}

TEST(Zero8bit, LambIsRefusedAndTheStateIsAQuarter) {
  EXPECT_NE(input_error_of([] {
              const Config cfg = zero_config("/tmp", "LAMB8bit", "deepspeed", 1, 1);
              ZeroBackend zero(cfg, one_rank());
              zero.prepare(std::make_shared<Net>(), cfg);
            }).find("cannot be sharded"),
            std::string::npos);
  Config cfg = zero_config("/tmp", "AdamW8bit", "deepspeed", 1, 1);
  cfg.optimizer.min_8bit_size = 0;  // everything 8-bit
  cfg.optimizer.keep_32bit_state = {};
  ZeroBackend zero(cfg, one_rank());
  zero.prepare(std::make_shared<Net>(), cfg);
  int64_t padded = 0, blocks = 0;
  for (const auto& l : zero.layouts()) padded += l.padded, blocks += quant8::num_blocks(l.part);
  EXPECT_EQ(zero.memory().optimizer_state, 2 * padded + 8 * blocks) << "two codes a parameter, two scales a block";
  // The default rules, as the whole-parameter optimizer's: lin1.weight (4096 elements) 8-bit,
  // the parameters under 4096 elements (lin2.weight 1024, the biases 256 and 4) fp32, the
  // padding after them an 8-bit run of its own in each group.
  const Config dflt = zero_config("/tmp", "AdamW8bit", "deepspeed", 1, 1);
  ZeroBackend zero2(dflt, one_rank());
  zero2.prepare(std::make_shared<Net>(), dflt);
  int64_t want = 8 * (1024 + 256 + 4) + 2 * 4096 + 8 * quant8::num_blocks(4096);
  for (const auto& l : zero2.layouts())
    if (l.padded > l.total) want += 2 * (l.padded - l.total) + 8;
  EXPECT_EQ(zero2.memory().optimizer_state, want);
}

// At one rank ZeRO's partition is the whole flat buffer, cut into runs at the same parameters as
// the whole-parameter AdamW8bit's 32-bit rules, with the 8-bit runs' blocks starting where the
// parameters start: the same losses as env_type pytorch, bit for bit.
TEST(Zero8bit, OneRankTakesTheWholeParameterOptimizersSteps) {
  TempDir tmp;
  const auto whole = train_net(tmp.path, "AdamW8bit", "pytorch", 1, 20);
  const auto zero = train_net(tmp.path, "AdamW8bit", "deepspeed", 1, 20);
  ASSERT_EQ(zero.size(), whole.size());
  for (size_t i = 0; i < zero.size(); ++i) EXPECT_EQ(zero[i], whole[i]) << "step " << i + 1;
}

}  // namespace
}  // namespace polytrain
