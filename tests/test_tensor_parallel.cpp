// env_type deepspeed+mpu (Megatron tensor parallelism): the slice arithmetic, the parallel
// layers against a reference layer at TP 1, 2 and 4 (real processes over Gloo), the contract
// (TP 2 x DP 1 and TP 2 x DP 2 reproduce the single-process run of BERT, GPT-2 and T5), dropout
// on the per-rank stream reproducible across a restart, the export, and the input errors.
#include <gtest/gtest.h>

#include <cctype>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/models/t5.h"
#include "polytrain/models/tp_layers.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/parallel/tensor_parallel/tp_region.h"
#include "polytrain/parallel/universal_state.h"
#include "polytrain/parallel/zero/zero_export.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/family_runs.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
using json = nlohmann::json;
using polytrain::testing::run_ranks;
using polytrain::testing::TempDir;
using polytrain::testing::free_port;
namespace fs = std::filesystem;
namespace F = torch::nn::functional;

using namespace polytrain::testing;  // the family runs (helpers/family_runs.h), gloo, expect_ranks_pass, max_diff

namespace {

// A failed check inside a rank process: say what, exit non-zero.
struct RankCheck {
  int rank;
  int failures = 0;
  void operator()(bool ok, const std::string& what) {
    if (!ok) {
      std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
      ++failures;
    }
  }
};

}  // namespace

// ---- slice arithmetic ----------------------------------------------------------------------

TEST(TpSlice, ColumnBlocksVocabPaddingAndHeadsRoundTrip) {
  auto w = torch::arange(6 * 12, torch::kFloat).view({6, 12});
  // GPT-2's c_attn [in, 3h]: each of q|k|v split on its own along dim 1.
  TpShardSpec qkv{1, 3, false, 12};
  auto r1 = tp_slice(w, qkv, 1, 2);
  EXPECT_TRUE(torch::equal(r1, torch::cat({w.narrow(1, 2, 2), w.narrow(1, 6, 2), w.narrow(1, 10, 2)}, 1)));
  EXPECT_TRUE(torch::equal(tp_assemble({tp_slice(w, qkv, 0, 2), r1}, qkv), w));
  // Vocabulary of 11 rows at p = 4: 3 rows each, the last rank holds 2 real rows and 1 of padding.
  auto v = torch::randn({11, 5});
  TpShardSpec vocab{0, 1, true, 11};
  std::vector<at::Tensor> parts;
  for (int r = 0; r < 4; ++r) parts.push_back(tp_slice(v, vocab, r, 4));
  EXPECT_EQ(parts[3].size(0), 3);
  EXPECT_TRUE(torch::equal(parts[3][2], torch::zeros({5})));
  EXPECT_TRUE(torch::equal(tp_assemble(parts, vocab), v));
  // A per-head table [buckets, heads] split by heads.
  TpShardSpec heads{1, 1, false, 4};
  EXPECT_TRUE(torch::equal(tp_slice(v.narrow(1, 0, 4), heads, 1, 2), v.narrow(1, 2, 2)));
}

TEST(TpLayers, PlainLayersDrawLikeTorchNn) {
  torch::manual_seed(3);
  torch::nn::Linear a(7, 5);
  torch::nn::Embedding e(torch::nn::EmbeddingOptions(9, 4).padding_idx(2));
  torch::manual_seed(3);
  Linear b(7, 5);
  Embedding f(9, 4, 2);
  EXPECT_TRUE(torch::equal(a->weight, b->weight));
  EXPECT_TRUE(torch::equal(a->bias, b->bias));
  EXPECT_TRUE(torch::equal(e->weight, f->weight));
  auto x = torch::randn({3, 7});
  EXPECT_TRUE(torch::equal(a(x), b(x)));
  auto ids = torch::tensor({{0, 2, 8}}, torch::kLong);
  EXPECT_TRUE(torch::equal(e(ids), f(ids)));
}

// ---- the parallel layers against a reference, at TP 1, 2, 4 ---------------------------------

namespace {

struct LayerZoo : torch::nn::Module {
  Linear col{nullptr}, col_gathered{nullptr}, row{nullptr}, row_scattered{nullptr};
  Embedding emb{nullptr};
  LayerZoo() {
    torch::manual_seed(21);
    col = register_module("col", Linear(8, 12));
    col_gathered = register_module("col_gathered", Linear(8, 12));
    row = register_module("row", Linear(12, 6));
    row_scattered = register_module("row_scattered", Linear(12, 6));
    emb = register_module("emb", Embedding(11, 8, 0));
  }
};

struct ZooPlan : TensorParallelPlanned {
  TpPlan tensor_parallel_plan() const override {
    TpPlan p;
    p.model = "zoo";
    p.layers = {{"col", TpStyle::kColumn},
                {"col_gathered", TpStyle::kColumn, 1, /*gather_output=*/true},
                {"row", TpStyle::kRow},
                {"row_scattered", TpStyle::kRow, 1, false, /*input_is_parallel=*/false},
                {"emb", TpStyle::kVocab}};
    return p;
  }
};

// Rank `rank` of `p`: every layer's output and gradients against torch's layer with the whole
// weight. Column outputs (gathered or not) and the embedding are bit-exact (the same dot
// products); gradients that sum over rows or over ranks, and the row layers' outputs (p
// partial products summed), agree within 1e-6.
int check_layers(int rank, int p, int port) {
  auto comm = gloo(rank, p, port);
  auto region = make_tp_region(*comm);
  RankCheck check{rank};
  LayerZoo ref, zoo;  // identical: same seed
  TpSharding sharding(zoo, ZooPlan().tensor_parallel_plan(), region, at::detail::createCPUGenerator(1));
  torch::manual_seed(100);  // every rank draws the same inputs
  auto x = torch::randn({3, 5, 8});
  auto up12 = torch::randn({3, 5, 12}), up6 = torch::randn({3, 5, 6});
  const int64_t c = 12 / p, begin = rank * c;

  {  // column
    auto xr = x.clone().requires_grad_(true), xt = x.clone().requires_grad_(true);
    auto yr = ref.col(xr);
    auto yt = zoo.col(xt);
    // A column shard's product is a GEMM of another width than the whole layer's; BLAS kernels
    // may block (and so sum) it differently (OpenBLAS's Prescott kernel does): a tolerance, not
    // bit equality.
    check(max_diff(yt, yr.narrow(-1, begin, c)) < 1e-5, "column output");
    yr.backward(up12);
    yt.backward(up12.narrow(-1, begin, c).contiguous());
    // Weight and bias gradients reduce over the 15 rows in another blocking than the whole
    // layer's [15, 12] product: within 1e-6, not bit for bit.
    check(max_diff(zoo.col->weight.grad(), ref.col->weight.grad().narrow(0, begin, c)) < 1e-6, "column dW");
    check(max_diff(zoo.col->bias.grad(), ref.col->bias.grad().narrow(0, begin, c)) < 1e-6, "column db");
    check(max_diff(xt.grad(), xr.grad()) < 1e-6, "column dX (all-reduced)");
  }
  {  // column, gathered
    auto yt = zoo.col_gathered(x);
    check(max_diff(yt, ref.col_gathered(x)) < 1e-5, "gathered column output");
  }
  {  // row, input already split
    auto hr = torch::randn({3, 5, 12});
    auto h = hr.clone().requires_grad_(true);
    auto hl = hr.narrow(-1, begin, c).clone().requires_grad_(true);
    auto yr = ref.row(h);
    auto yt = zoo.row(hl);
    check(max_diff(yt, yr) < 1e-6, "row output");
    yr.backward(up6);
    yt.backward(up6);
    check(max_diff(zoo.row->weight.grad(), ref.row->weight.grad().narrow(1, begin, c)) < 1e-6, "row dW");
    check(torch::equal(zoo.row->bias.grad(), ref.row->bias.grad()), "row db (replicated)");
    check(max_diff(hl.grad(), h.grad().narrow(-1, begin, c)) < 1e-5, "row dX");
  }
  {  // row, input scattered first
    auto h = torch::randn({3, 5, 12}).requires_grad_(true);
    auto h2 = h.detach().clone().requires_grad_(true);
    auto yr = ref.row_scattered(h);
    auto yt = zoo.row_scattered(h2);
    check(max_diff(yt, yr) < 1e-6, "scattered row output");
    yr.backward(up6);
    yt.backward(up6);
    check(max_diff(h2.grad(), h.grad()) < 1e-6, "scattered row dX (gathered)");
  }
  {  // vocab-parallel embedding: 11 rows, padding_idx 0, every id looked up
    auto ids = torch::tensor({{0, 1, 2, 3, 4, 5}, {6, 7, 8, 9, 10, 0}}, torch::kLong);
    auto up = torch::randn({2, 6, 8});
    auto yr = ref.emb(ids);
    auto yt = zoo.emb(ids);
    check(torch::equal(yt, yr), "embedding output");
    yr.backward(up);
    yt.backward(up);
    const int64_t per = (11 + p - 1) / p, vb = rank * per, valid = std::max<int64_t>(0, std::min(per, 11 - vb));
    auto g = zoo.emb->weight.grad();
    check(g.size(0) == per, "embedding rows");
    if (valid > 0) check(torch::equal(g.narrow(0, 0, valid), ref.emb->weight.grad().narrow(0, vb, valid)), "embedding dW");
    if (valid < per) check(g.narrow(0, valid, per - valid).abs().sum().item<double>() == 0.0, "padding rows get no gradient");
  }
  {  // vocab-parallel cross entropy vs torch's on the whole vocabulary; and lm_loss / lm_logits
    auto logits = torch::randn({7, 11}, torch::kDouble).to(torch::kFloat);
    auto labels = torch::tensor({3, -100, 10, 0, 7, -100, 5}, torch::kLong);
    auto lr = logits.clone().requires_grad_(true);
    auto ref_loss = F::cross_entropy(lr, labels, F::CrossEntropyFuncOptions().ignore_index(-100));
    ref_loss.backward();
    TpShardSpec cols{1, 1, true, 11};
    auto local = tp_slice(logits, cols, rank, p).requires_grad_(true);
    const int64_t per = (11 + p - 1) / p, vb = rank * per, valid = std::max<int64_t>(0, std::min(per, 11 - vb));
    auto loss = region->vocab_cross_entropy(local, labels, vb, valid, -100);
    check(std::abs(loss.item<double>() - ref_loss.item<double>()) < 1e-6 * std::abs(ref_loss.item<double>()),
          "vocab-parallel cross entropy");
    loss.backward();
    check(max_diff(local.grad(), tp_slice(lr.grad(), cols, rank, p)) < 1e-7, "vocab-parallel cross entropy gradient");
    // As an LM head on the split embedding: loss and logits equal the plain head's.
    auto h = torch::randn({7, 8});
    auto plain = F::cross_entropy(F::linear(h, ref.emb->weight), labels, F::CrossEntropyFuncOptions().ignore_index(-100));
    auto split = lm_loss(h, zoo.emb->weight, at::Tensor(), labels, zoo.emb->tp);
    check(std::abs(split.item<double>() - plain.item<double>()) < 1e-5 * std::abs(plain.item<double>()), "lm_loss");
    check(max_diff(lm_logits(h, zoo.emb->weight, at::Tensor(), zoo.emb->tp), F::linear(h, ref.emb->weight)) < 1e-6,
          "lm_logits (gathered, padding dropped)");
  }
  {  // the gather back: the whole model again
    torch::NoGradGuard no_grad;
    sharding.unshard(zoo, *comm);
    for (const auto& item : ref.named_parameters())
      check(torch::equal(zoo.named_parameters()[item.key()], item.value()), "unshard " + item.key());
  }
  return check.failures == 0 ? 0 : 1;
}

}  // namespace

TEST(TpLayers, ColumnRowVocabAndCrossEntropyMatchTheReferenceAtTp1_2_4) {
  for (int p : {1, 2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(p));
    const int port = free_port();
    std::fflush(nullptr);
    expect_ranks_pass(run_ranks(p, std::chrono::seconds(120), [&](int rank) { return check_layers(rank, p, port); }));
  }
}

// ---- the contract: BERT, GPT-2, T5 at TP 2 x DP 1 and TP 2 x DP 2 vs one process -------------

class TpContract : public ::testing::TestWithParam<std::string> {};

// TP 2 x DP 1, TP 2 x DP 2 (Megatron's DDP over the dp group) and TP 2 x DP 2 with ZeRO-2 and
// the optimizer offloaded to the CPU (the TP transform, then ZeRO over the dp group: FlagAI's
// deepspeed+mpu) against one process.
TEST_P(TpContract, Tp2Dp1Tp2Dp2AndTp2Dp2Zero2OffloadReproduceOneProcessOver30Steps) {
  TpRun z{4, 2};
  z.zero = 2;
  z.offload = true;
  expect_runs_follow_one_process(GetParam(), "tp_contract",
                                 {{"tp2 x dp1", TpRun{2, 2}}, {"tp2 x dp2", TpRun{4, 2}},
                                  {"tp2 x dp2 ZeRO-2 + offload_optimizer", z}});
}

// ZeRO stage 3 (every layer's parameters partitioned: the persistence threshold at 0) against
// one process: at 2 and 4 ranks, each without and with the parameters and the optimizer
// offloaded to the CPU; and TP 2 x DP 2 (each TP part partitioned over its dp group).
TEST_P(TpContract, Zero3AtDp2Dp4OffloadAndTp2Dp2ReproducesOneProcessOver30Steps) {
  TpRun dp2{2, 0}, dp4{4, 0}, tp2dp2{4, 2};
  dp2.env = dp4.env = "deepspeed";
  dp2.zero = dp4.zero = tp2dp2.zero = 3;
  TpRun dp2_offload = dp2, dp4_offload = dp4;
  dp2_offload.offload = dp4_offload.offload = true;
  expect_runs_follow_one_process(GetParam(), "zero3_contract",
                                 {{"ZeRO-3 at dp 2", dp2},
                                  {"ZeRO-3 at dp 2 + offload_param + offload_optimizer", dp2_offload},
                                  {"ZeRO-3 at dp 4", dp4},
                                  {"ZeRO-3 at dp 4 + offload_param + offload_optimizer", dp4_offload},
                                  {"tp2 x dp2 ZeRO-3", tp2dp2}});
}

// ZeRO-3 in bf16 (bf16 parameters, fp32 masters) against ZeRO-2 in bf16 on the same ranks. At 2
// ranks: the same reductions of the same bf16 gradients, so the same losses and weights bit for
// bit (the gathers move the parameters, they change no value). At 4 ranks with the offloads:
// within bf16 rounding of stage 2 (measured 1.5e-4; the reduce buffers hold other runs of
// parameters, as stage 3 groups them by block, and a sum of four bf16 values can round in
// another order, where a sum of two cannot). Both
// against one process in bf16 within bf16 rounding (the ranks' gradients are summed in another
// order).
TEST_P(TpContract, Zero3InBf16FollowsZero2OnTheSameRanks) {
  const std::string family = GetParam();
  TempDir tmp("zero3_bf16");
  TpRun r{1, 0};
  r.env = "deepspeed";
  r.zero = 2;
  r.bf16 = true;
  train(family, tmp.path / "one", r);
  const auto l1 = losses(tmp.path / "one");
  for (const int world : {2, 4}) {
    const std::string w = std::to_string(world);
    const fs::path z2 = tmp.path / ("zero2_" + w), z3 = tmp.path / ("zero3_" + w);
    r.world = world;
    r.offload = world == 4;
    r.zero = 2;
    train(family, z2, r);
    r.zero = 3;
    train(family, z3, r);
    const auto l2 = losses(z2), l3 = losses(z3);
    ASSERT_EQ(l2.size(), l3.size());
    double worst = 0, worst2 = 0;
    for (size_t i = 0; i < l1.size(); ++i) worst = std::max(worst, std::abs(l3[i] / l1[i] - 1));
    for (size_t i = 0; i < l2.size(); ++i) worst2 = std::max(worst2, std::abs(l3[i] / l2[i] - 1));
    std::printf("[zero3] %s bf16 at %d ranks%s: worst relative loss difference vs stage 2 %.3g, vs one process %.3g\n",
                family.c_str(), world, r.offload ? " + offload" : "", worst2, worst);
    EXPECT_LT(worst, 0.01);
    if (world == 2) {
      for (size_t i = 0; i < l2.size(); ++i) EXPECT_EQ(l2[i], l3[i]) << family << " step " << i + 1;
      std::map<std::string, at::Tensor> w2;
      for (auto& [name, t] : load_safetensors((z2 / "model.safetensors").string())) w2[name] = t;
      for (auto& [name, t] : load_safetensors((z3 / "model.safetensors").string()))
        EXPECT_TRUE(torch::equal(t, w2.at(name))) << family << ": " << name;
    } else {
      EXPECT_LT(worst2, 0.01);
    }
    EXPECT_LT(l3.back(), l3.front());
  }
}

// GPT-2 with bf16 autocast and ZeRO-1 at TP 2 x DP 2 against ZeRO-1 in one process: the same
// bf16 matmuls, but the row-parallel layers add two bf16 partial products instead of one, so the
// runs agree to bf16 rounding, not to fp32's.
TEST(TpZero, Gpt2Bf16Zero1AtTp2Dp2FollowsOneProcess) {
  TempDir tmp("tp_zero_bf16");
  const fs::path one = tmp.path / "one", grid = tmp.path / "grid";
  TpRun a{1, 0}, b{4, 2};
  a.env = "deepspeed";
  a.zero = b.zero = 1;
  a.bf16 = b.bf16 = true;
  train("gpt2", one, a);
  train("gpt2", grid, b);
  const auto la = losses(one), lb = losses(grid);
  ASSERT_EQ(la.size(), lb.size());
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(lb[i] / la[i] - 1));
  std::printf("[tp] gpt2 bf16 ZeRO-1 tp2 x dp2 vs one process: worst relative loss difference over %zu steps %.3g\n",
              la.size(), worst);
  EXPECT_LT(worst, 0.01);
  EXPECT_LT(la.back(), la.front());
}

// fp16's loss scaling under TP 2 x DP 2 with ZeRO-2 and the optimizer offloaded, driven through
// the backend as the loop drives it: the loss is multiplied by the scale (2^10, exact in fp32)
// and the step divides the partitioned gradients by it before the norm, the clip and the
// update, so the run follows one unscaled process. A gradient made infinite on one rank (TP
// rank 1 of the second data-parallel group) skips that step on all four, weights untouched.
// The compute is fp32: libtorch 1.13 has no fp16 matmul on the CPU (fp16.enabled needs CUDA).
TEST(TpZero, LossScaledStepsFollowOneProcessAndAnOverflowOnOneRankSkipsOnAll) {
  TempDir tmp("tp_zero_scale");
  constexpr int64_t kSteps = 7, kOverflowAt = 2;  // the third step overflows on rank 3
  constexpr double kScale = 1024.0;
  auto run = [&](const TpRun& r, const fs::path& out, double scale) {
    const int port = free_port();
    std::fflush(nullptr);
    auto status = run_ranks(r.world, std::chrono::seconds(240), [&](int rank) {
      Config cfg = run_config(tmp.path / out.filename(), r);
      auto backend = r.world > 1 ? make_backend(cfg, gloo(rank, r.world, port)) : make_backend(cfg);
      torch::manual_seed(cfg.trainer.seed);  // as the Trainer does: one initial model everywhere
      at::set_num_threads(1);
      auto model = make_model("gpt2", 0.0);
      backend->prepare(model, cfg);
      auto& gpt = dynamic_cast<Gpt2LMHeadModelImpl&>(*model);
      TokenSource data("gpt2", 64);
      std::vector<double> losses, norms;
      for (int64_t step = 0; step < kSteps; ++step) {
        const bool overflow = step == kOverflowAt;
        if (overflow && scale == 1.0) continue;  // the reference skips that batch too
        const int64_t first = (step % 2) * 4;  // two batches, alternating
        const Batch b = data.make_batch({first, first + 1, first + 2, first + 3}, 0);
        const at::Tensor loss = gpt.forward(b.at("input_ids"), b.at("attention_mask"), b.at("labels")).loss;
        at::Tensor scaled = loss * scale;
        if (overflow && rank == 3) scaled = scaled * std::numeric_limits<float>::infinity();
        std::vector<at::Tensor> before;
        for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
        backend->backward(scaled, MicroStep{4, true});
        const StepResult res = backend->step(StepRequest{0.003, std::nullopt, scale}, step);
        if (!overflow) {
          if (!res.applied()) return 10 + static_cast<int>(step);
          losses.push_back(loss.item<double>());
          norms.push_back(res.grad_norm);
          continue;
        }
        if (res.outcome != StepOutcome::kSkippedNonFinite) return 20;
        size_t i = 0;
        for (const auto& p : model->parameters())
          if (!torch::equal(p.detach(), before[i++])) return 21;
      }
      backend->release_model(*model);
      if (rank == 0) {
        std::ofstream(out / "losses.json") << json(losses).dump();
        std::ofstream(out / "norms.json") << json(norms).dump();
        NamedTensors state;
        for (const auto& p : model->named_parameters()) state.emplace_back(p.key(), p.value().detach());
        save_safetensors((out / "model.safetensors").string(), state, {});
      }
      return 0;
    });
    expect_ranks_pass(status);
  };
  const fs::path one = tmp.path / "one", grid = tmp.path / "grid";
  fs::create_directories(one), fs::create_directories(grid);
  TpRun z{4, 2};
  z.zero = 2;
  z.offload = true;
  run(TpRun{1, 0}, one, 1.0);
  run(z, grid, kScale);
  expect_same_run(one, grid, 1e-5, "gpt2 tp2 x dp2 ZeRO-2 + offload at loss scale 1024");
  // The norm the clip and the log see is the unscaled one (Adam alone would hide a missing
  // unscale: it is nearly invariant to the gradients' scale).
  json a, b;
  std::ifstream(one / "norms.json") >> a;
  std::ifstream(grid / "norms.json") >> b;
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i].get<double>(), a[i].get<double>(), 1e-5 * a[i].get<double>()) << i;
}

// amp O2 under tensor parallelism: bf16 weights, fp32 masters over each rank's slices (the
// norm summed over the TP group). TP 2 follows one process to bf16 rounding (the row-parallel
// partial sums are added in bf16, in another order).
TEST_P(TpContract, AmpO2AtTp2FollowsOneProcess) {
  const std::string family = GetParam();
  TempDir tmp("tp_amp");
  const fs::path one = tmp.path / "one", tp2 = tmp.path / "tp2";
  TpRun a{1, 0}, b{2, 2};
  a.amp_o2 = b.amp_o2 = true;
  train(family, one, a);
  train(family, tp2, b);
  const auto la = losses(one), lb = losses(tp2);
  ASSERT_EQ(la.size(), lb.size());
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(lb[i] / la[i] - 1));
  std::printf("[tp] %s amp O2: worst relative loss difference tp2 vs one process over %zu steps: %.3g\n", family.c_str(),
              la.size(), worst);
  EXPECT_LT(worst, 0.03) << family;
  EXPECT_LT(la.back(), la.front()) << family << ": the loss went down";
  for (const auto& [name, t] : load_safetensors((tp2 / "model.safetensors").string())) {
    std::string lower = name;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool norm = lower.find("norm") != std::string::npos || lower.find("ln_") != std::string::npos;
    EXPECT_EQ(t.scalar_type(), norm ? at::kFloat : at::kBFloat16) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TpContract, ::testing::Values("gpt2", "bert", "t5"));

// Dropout on: the TP 2 run is the same after a restart (the per-rank streams are in the
// checkpoint), and its loss curve matches TP 1's in distribution: the mean loss of steps 21-30
// within 3% of TP 1's (dropout masks differ, the data and model do not).
TEST(TpDropout, ReproducibleAcrossARestartAndLikeTp1InDistribution) {
  TempDir tmp("tp_dropout");
  const fs::path whole = tmp.path / "whole", split = tmp.path / "split", tp1 = tmp.path / "tp1";
  train("gpt2", whole, TpRun{2, 2, 30, 0.1});
  train("gpt2", split, TpRun{2, 2, 15, 0.1, 15});
  train("gpt2", split, TpRun{2, 2, 30, 0.1, 15, /*resume=*/true});
  train("gpt2", tp1, TpRun{1, 0, 30, 0.1});
  const auto a = losses(whole), b = losses(split), c = losses(tp1);
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 15u);  // the resumed run's steps 16-30
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(a[15 + i], b[i]) << "step " << 16 + i;
  double ma = 0, mc = 0;
  for (size_t i = 20; i < 30; ++i) ma += a[i] / 10, mc += c[i] / 10;
  EXPECT_NEAR(ma, mc, 0.03 * mc);
  EXPECT_NE(a, c);  // the masks do differ
}

// A GPT-2 trained at TP 2, exported in HF layout, loads at TP 1, 2 and 4 with the same logits.
TEST(TpExport, Gpt2TrainedAtTp2LoadsAtTp1AndTp4WithTheSameLogits) {
  TempDir tmp("tp_export");
  const fs::path run = tmp.path / "run", hf = tmp.path / "hf";
  {
    const int port = free_port();
    std::fflush(nullptr);
    expect_ranks_pass(run_ranks(2, std::chrono::seconds(300), [&](int rank) {
      Config cfg = run_config(run, TpRun{2, 2, 5});
      FamilyTrainer trainer(cfg, "gpt2");
      trainer.set_backend(std::make_unique<DdpBackend>(cfg, gloo(rank, 2, port)));
      auto model = make_model("gpt2", 0.0);
      TokenSource data("gpt2", 64);
      trainer.train(model, data);
      if (rank == 0) std::dynamic_pointer_cast<Gpt2LMHeadModelImpl>(model)->save_pretrained(hf.string());
      return 0;
    }));
  }
  auto ids = torch::tensor({{5, 9, 17, 33, 70, 100, 4, 8}}, torch::kLong);
  auto reference = Gpt2LMHeadModelImpl::from_pretrained(hf.string())->forward(ids).logits;
  torch::save(reference, (tmp.path / "tp1.pt").string());
  for (int p : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(p));
    const int port = free_port();
    std::fflush(nullptr);
    expect_ranks_pass(run_ranks(p, std::chrono::seconds(120), [&](int rank) {
      Config cfg = run_config(tmp.path / "load", TpRun{p, p, 1});
      DdpBackend backend(cfg, gloo(rank, p, port));
      auto model = Gpt2LMHeadModelImpl::from_pretrained(hf.string());
      backend.prepare(model, cfg);
      model->eval();
      torch::NoGradGuard no_grad;
      auto logits = model->forward(ids).logits;
      at::Tensor ref;
      torch::load(ref, (tmp.path / "tp1.pt").string());
      const double d = max_diff(logits, ref);
      if (d > 1e-5) std::fprintf(stderr, "rank %d: logits differ by %g\n", rank, d);
      return d <= 1e-5 ? 0 : 1;
    }));
  }
}

// ---- universal checkpoints: every layout resumes every other ----------------------------------

namespace {

struct Layout {
  const char* label;
  TpRun run;
};

std::vector<Layout> checkpoint_layouts() {
  auto make = [](int world, int tp, const char* env, int zero, bool offload) {
    TpRun r{world, tp};
    r.env = env;
    r.zero = zero;
    r.offload = offload;
    return r;
  };
  return {{"pytorch", make(1, 0, "pytorch", 0, false)},
          {"pytorchDDP x2", make(2, 1, "pytorchDDP", 0, false)},
          {"ZeRO-1 x2", make(2, 1, "deepspeed", 1, false)},
          {"ZeRO-2+offload x4", make(4, 1, "deepspeed", 2, true)},
          {"TP2 (mpu)", make(2, 2, "deepspeed+mpu", 0, false)},
          {"TP2xDP2 ZeRO-2", make(4, 2, "deepspeed+mpu", 2, false)}};
}

// Resumes `run` from the checkpoint in `saved` into `resumed` up to step `total`; the worst
// relative difference of the resumed steps' losses from `ref` (the uninterrupted run's), or
// infinity when the resumed run has not the expected number of steps.
double resumed_worst(const fs::path& saved, const fs::path& resumed, TpRun run, int64_t total, int64_t saved_at,
                     const std::vector<double>& ref) {
  run.steps = total;
  train("gpt2", resumed, run, [&](Config& c) {
    c.trainer.load_dir = (saved / "ckpt").string();
    c.trainer.save_dir = (resumed / "ckpt").string();
  });
  const auto got = losses(resumed);
  EXPECT_EQ(got.size(), static_cast<size_t>(total - saved_at));
  if (got.size() != static_cast<size_t>(total - saved_at)) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] / ref[saved_at + i] - 1));
  return worst;
}

}  // namespace

// A checkpoint saved at step 3 by each layout resumes under each layout (36 pairs) and the
// resumed steps 4-6 follow the uninterrupted one-process run: the optimizer state (moments,
// step counts), the LR schedule and the data position carry over whatever the grid.
TEST(UniversalCheckpoint, EveryLayoutResumesEveryOtherOnTheUninterruptedCurve) {
  TempDir tmp("universal");
  const auto layouts = checkpoint_layouts();
  const int64_t total = 6, saved_at = 3;
  TpRun ref_run{1, 0, total};
  train("gpt2", tmp.path / "reference", ref_run);
  const auto ref = losses(tmp.path / "reference");
  ASSERT_EQ(ref.size(), static_cast<size_t>(total));
  std::string table = "[universal] worst relative loss difference of steps 4-6 vs the uninterrupted run\n";
  table += "  saved by \\ resumed by";
  for (const auto& l : layouts) table += std::string(" | ") + l.label;
  table += "\n";
  double worst_all = 0;
  for (size_t s = 0; s < layouts.size(); ++s) {
    const fs::path saved = tmp.path / ("saved_" + std::to_string(s));
    TpRun save = layouts[s].run;
    save.steps = saved_at;
    save.save_interval = saved_at;
    train("gpt2", saved, save);
    table += std::string("  ") + layouts[s].label;
    for (size_t r = 0; r < layouts.size(); ++r) {
      SCOPED_TRACE(std::string(layouts[s].label) + " -> " + layouts[r].label);
      const double worst = resumed_worst(saved, tmp.path / ("resumed_" + std::to_string(s) + "_" + std::to_string(r)),
                                         layouts[r].run, total, saved_at, ref);
      EXPECT_LE(worst, 1e-5);
      worst_all = std::max(worst_all, worst);
      char cell[32];
      std::snprintf(cell, sizeof cell, " | %.1e", worst);
      table += cell;
    }
    table += "\n";
  }
  std::printf("%s[universal] worst of all 36: %.2e\n", table.c_str(), worst_all);
}

// ZeRO-3 checkpoints in the universal layout: saved at step 3 by ZeRO-3 at 2 ranks, resumed in
// one process, by ZeRO-2 + offload at 4 ranks and by ZeRO-3 itself; and a ZeRO-1 checkpoint
// resumed by ZeRO-3 at 4 ranks with offload_param: steps 4-6 follow the uninterrupted run.
TEST(UniversalCheckpoint, Zero3SavesAndResumesAcrossLayoutsOnTheUninterruptedCurve) {
  TempDir tmp("universal_zero3");
  const int64_t total = 6, saved_at = 3;
  train("gpt2", tmp.path / "reference", TpRun{1, 0, total});
  const auto ref = losses(tmp.path / "reference");
  auto make = [](int world, const char* env, int zero, bool offload) {
    TpRun r{world, 1};
    r.env = env, r.zero = zero, r.offload = offload;
    return r;
  };
  const TpRun zero3 = make(2, "deepspeed", 3, false), zero1 = make(2, "deepspeed", 1, false);
  const std::vector<std::pair<TpRun, std::vector<std::pair<const char*, TpRun>>>> pairs = {
      {zero3, {{"pytorch", make(1, "pytorch", 0, false)}, {"ZeRO-2+offload x4", make(4, "deepspeed", 2, true)},
               {"ZeRO-3 x2", zero3}}},
      {zero1, {{"ZeRO-3+offload_param x4", make(4, "deepspeed", 3, true)}}}};
  for (size_t s = 0; s < pairs.size(); ++s) {
    const fs::path saved = tmp.path / ("saved_" + std::to_string(s));
    TpRun save = pairs[s].first;
    save.steps = saved_at, save.save_interval = saved_at;
    train("gpt2", saved, save);
    if (s == 0) {  // zero_to_fp32's reader puts the stage-3 partitions back together: the model saved
      const CheckpointReader ck((saved / "ckpt").string(), latest_checkpoint_tag((saved / "ckpt").string()));
      const ZeroConsolidated whole = consolidate_zero_shards(ShardReader(ck));
      EXPECT_EQ(whole.shards, 2);
      std::map<std::string, at::Tensor> model;
      for (auto& [name, t] : load_safetensors((saved / "model.safetensors").string())) model[name] = t;
      for (const auto& [name, st] : whole.params) {
        ASSERT_TRUE(model.count(name)) << name;
        EXPECT_TRUE(torch::equal(st.master.reshape(model[name].sizes()), model[name])) << name;
      }
      EXPECT_EQ(whole.params.size(), model.size());
    }
    for (size_t r = 0; r < pairs[s].second.size(); ++r) {
      const auto& [label, resume] = pairs[s].second[r];
      SCOPED_TRACE(std::string(s == 0 ? "ZeRO-3 x2" : "ZeRO-1 x2") + " -> " + label);
      const double worst = resumed_worst(saved, tmp.path / ("resumed_" + std::to_string(s) + "_" + std::to_string(r)),
                                         resume, total, saved_at, ref);
      std::printf("[universal] %s: worst relative loss difference of steps 4-6 %.2e\n", label, worst);
      EXPECT_LE(worst, 1e-5);
    }
  }
}

// The whole optimizer state of a TP 2 x DP 2 ZeRO-2 checkpoint put back together equals the
// one of a TP 2 (Megatron DDP) checkpoint of the same run, element for element within fp32
// rounding, and zero_to_fp32's reader sees every parameter whole.
TEST(UniversalCheckpoint, TpZeroAndTpDdpShardsConsolidateToTheSameState) {
  TempDir tmp("universal_same");
  const auto layouts = checkpoint_layouts();
  std::map<std::string, std::map<std::string, at::Tensor>> first;
  for (size_t k : {size_t{4}, size_t{5}}) {
    TpRun r = layouts[k].run;
    r.steps = 2;
    r.save_interval = 2;
    const fs::path dir = tmp.path / std::to_string(k);
    train("gpt2", dir, r);
    const CheckpointReader ck((dir / "ckpt").string(), latest_checkpoint_tag((dir / "ckpt").string()));
    const UniversalState state = read_universal_state(ShardReader(ck));
    EXPECT_EQ(state.step, 2);
    auto ref = make_model("gpt2", 0.0);
    int64_t trainable = 0;
    for (const auto& p : ref->parameters()) trainable += p.numel();
    EXPECT_EQ(state.elements, trainable) << layouts[k].label;
    for (const auto& [name, ps] : state.params) {
      ASSERT_TRUE(ps.stats.count("exp_avg_sq")) << name;
      if (k == 4) {
        first[name] = ps.stats;
        continue;
      }
      ASSERT_TRUE(first.count(name)) << name;
      for (const char* stat : {"exp_avg", "exp_avg_sq"}) {
        const at::Tensor& a = first[name][stat];
        const at::Tensor& b = ps.stats.at(stat);
        ASSERT_EQ(a.sizes(), b.sizes()) << name;
        EXPECT_LE(max_diff(a, b), 1e-6 * std::max(1.0, a.abs().max().item<double>())) << name << " " << stat;
      }
    }
  }
}

// The reader checks coverage: two shards that both hold elements 4-7 of a parameter (an
// overlap), or that leave elements 8-11 out (a gap), are refused naming the parameter; the
// same pieces without either put the parameter back together whole.
TEST(UniversalCheckpoint, AGapOrAnOverlapIsAnErrorNamingTheParameter) {
  TempDir tmp("universal_cover");
  const at::Tensor m = torch::arange(12, torch::kFloat), v = torch::arange(12, torch::kFloat) * 2;
  auto piece = [&](int64_t begin, int64_t length) {
    StatePiece p;
    p.name = "h.0.mlp.c_fc.weight";
    p.whole_shape = {3, 4};
    p.begin = begin;
    p.length = length;
    p.step = 7;
    p.stats = {{"exp_avg", m.narrow(0, begin, length)}, {"exp_avg_sq", v.narrow(0, begin, length)}};
    return p;
  };
  auto save = [&](const std::string& tag, const std::vector<std::vector<StatePiece>>& shards) {
    CheckpointGroup group;
    CheckpointWriter w(tmp.path.string(), tag, group);
    for (size_t r = 0; r < shards.size(); ++r) {
      torch::serialize::OutputArchive a;
      write_state_pieces(a, shards[r]);
      w.write_archive(ShardReader::file_name(static_cast<int64_t>(r)), a);
    }
    const int64_t world = static_cast<int64_t>(shards.size());
    w.commit({{"env_type", "deepspeed"}, {"grid", {{"world", world}, {"tp", 1}, {"dp", world}, {"pp", 1}}}}, false);
  };
  auto error = [&](const std::string& tag) {
    try {
      read_universal_state(ShardReader(CheckpointReader(tmp.path.string(), tag)));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  save("whole", {{piece(0, 6)}, {piece(6, 6)}});
  const UniversalState ok = read_universal_state(ShardReader(CheckpointReader(tmp.path.string(), "whole")));
  ASSERT_EQ(ok.params.size(), 1u);
  EXPECT_EQ(ok.step, 7);
  EXPECT_TRUE(torch::equal(ok.params[0].second.stats.at("exp_avg_sq"), v.view({3, 4})));
  save("overlap", {{piece(0, 8)}, {piece(4, 8)}});
  EXPECT_NE(error("overlap").find("'h.0.mlp.c_fc.weight' is saved more than once (an overlap)"), std::string::npos)
      << error("overlap");
  save("gap", {{piece(0, 8)}, {}});
  EXPECT_NE(error("gap").find("'h.0.mlp.c_fc.weight' is missing elements (a gap)"), std::string::npos) << error("gap");
}

// ---- bad input -------------------------------------------------------------------------------

namespace {

// Every rank of a `world`-process job must fail prepare() or construction with an InputError
// containing `expected`.
void expect_input_error(int world, int tp, const std::string& family, const std::string& expected,
                        const std::function<void(Config&)>& edit = {}) {
  expect_prepare_error(TpRun{world, tp}, family, expected, edit);
}

}  // namespace

// Rank 0's experiment folder reaches every rank of the grid (Backend::share): under TP a
// rank's data-parallel group starts at another rank (rank 3's dp group is {1, 3}), so a share
// over that group handed ranks 1 and 3 their own empty folder name and the first checkpoint
// of a launched TP run failed on them.
TEST(TpGrid, RankZerosValueReachesEveryRankOfTheGrid) {
  for (int zero : {0, 2}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(zero));
    TempDir tmp("tp_share");
    TpRun r{4, 2};
    r.zero = zero;
    const int port = free_port();
    auto status = run_ranks(4, std::chrono::seconds(120), [&](int rank) {
      Config cfg = run_config(tmp.path, r);
      auto backend = make_backend(cfg, gloo(rank, 4, port));
      return backend->share("from rank " + std::to_string(rank)) == "from rank 0" ? 0 : 10 + rank;
    });
    expect_ranks_pass(status);
  }
}

TEST(TpErrors, HeadsNotDivisibleByTheTensorParallelSize) {
  expect_input_error(3, 3, "gpt2", "model.n_head (4) is not divisible by model_parallel_size (3)");
}

TEST(TpErrors, ModelWithoutAPlan) { expect_input_error(2, 2, "mlp", "has no tensor-parallel plan"); }


TEST(TpErrors, ModelParallelSizeMustDivideTheWorld) {
  TempDir tmp("tp_error");
  try {
    run_config(tmp.path, TpRun{3, 2});
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model_parallel_size (2) does not divide the world size (3)"), std::string::npos)
        << e.what();
  }
}

