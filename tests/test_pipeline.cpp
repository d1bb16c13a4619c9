// Pipeline parallelism: the schedules as data (every micro-batch once, no deadlock, the bubble
// theory predicts, 1F1B's activation bound), the partition, the grid, the configuration and its
// one-line errors, point-to-point traffic with varying shapes over real ranks (the deadlock
// sweep), and the contract: GPT-2, BERT and T5 cut into 2 and 4 stages, and PP 2 x DP 2, PP 2 x
// TP 2, PP 2 x DP 2 with ZeRO-2, reproduce one process over 30 steps; checkpoints resume across
// pipeline sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/parallel_dims.h"
#include "polytrain/parallel/pipeline/pipeline_stage.h"
#include "polytrain/parallel/pipeline/pp_schedule.h"
#include "polytrain/parallel/process_grid.h"
#include "helpers/family_runs.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
using namespace polytrain::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string input_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

// ---- schedules -------------------------------------------------------------------------------

TEST(PipeSchedule, EveryStageRunsEachMicroBatchOnceForwardFirstAndNoListDeadlocks) {
  for (const std::string kind : {"1f1b", "gpipe", "zbh1"})
    for (int64_t P = 2; P <= 4; ++P)
      for (int64_t V = 1; V <= (kind == "1f1b" ? 3 : 1); ++V)
        for (int64_t M = 1; M <= 9; ++M) {
          if (!pipeline_schedule_error(kind, P, V, M).empty()) continue;
          const std::string what = kind + " P " + std::to_string(P) + " V " + std::to_string(V) + " M " + std::to_string(M);
          for (int64_t s = 0; s < P; ++s) {
            std::set<std::pair<int64_t, int64_t>> forwards, backwards, weights;
            for (const PipeAction& a : pipeline_schedule(kind, P, V, M, s)) {
              const auto key = std::make_pair(a.micro, a.chunk);
              if (a.weight) {
                EXPECT_TRUE(backwards.count(key)) << what << ": W before B";
                EXPECT_TRUE(weights.insert(key).second) << what;
              } else if (a.forward) {
                EXPECT_TRUE(forwards.insert(key).second) << what;
              } else {
                EXPECT_TRUE(forwards.count(key)) << what << ": backward before forward";
                EXPECT_TRUE(backwards.insert(key).second) << what;
              }
            }
            EXPECT_EQ(forwards.size(), static_cast<size_t>(M * V)) << what;
            EXPECT_EQ(backwards.size(), static_cast<size_t>(M * V)) << what;
            EXPECT_EQ(weights.size(), kind == "zbh1" ? static_cast<size_t>(M) : 0u) << what;
          }
          const ScheduleReplay r = simulate_schedule(kind, P, V, M);
          EXPECT_FALSE(r.deadlock) << what;
          for (int64_t s = 0; s < P; ++s) {
            // PipeDream-flush keeps at most P - s micro-batches' activations; GPipe all of them.
            if (kind == "gpipe") EXPECT_EQ(r.peak_in_flight[s], M) << what;
            if (kind == "1f1b" && V == 1) EXPECT_EQ(r.peak_in_flight[s], std::min(P - s, M)) << what;
          }
        }
}

TEST(PipeSchedule, BubbleMatchesTheoryAndInterleavingShrinksIt) {
  for (int64_t P : {2, 4})
    for (int64_t M : {4, 8}) {
      // 1F1B and GPipe: the first and last stages idle (P - 1) / (M + P - 1) of the step.
      for (const std::string kind : {"1f1b", "gpipe"}) {
        const ScheduleReplay r = simulate_schedule(kind, P, 1, M, 1.0, 2.0);
        EXPECT_NEAR(r.idle_fraction.front(), theoretical_bubble(P, 1, M), 1e-12) << kind << " P " << P << " M " << M;
      }
      const ScheduleReplay one = simulate_schedule("1f1b", P, 1, M, 1.0, 2.0);
      const ScheduleReplay two = simulate_schedule("1f1b", P, 2, M, 0.5, 1.0);  // each chunk half a stage
      EXPECT_LT(two.idle_fraction.front(), one.idle_fraction.front()) << "P " << P << " M " << M;
      EXPECT_NEAR(two.idle_fraction.front(), theoretical_bubble(P, 2, M), 1e-12) << "P " << P << " M " << M;
      // ZB-H1 (B and W half a backward each) fills the cool-down: less idle than 1F1B everywhere.
      const ScheduleReplay zb = simulate_schedule("zbh1", P, 1, M, 1.0, 2.0);
      for (int64_t s = 0; s < P; ++s) EXPECT_LT(zb.idle_fraction[s], one.idle_fraction[s]) << "P " << P << " M " << M;
    }
}

TEST(PipeSchedule, RefusesWhatCannotRun) {
  EXPECT_NE(pipeline_schedule_error("1f1b", 4, 2, 3).find("at least as many micro-batches"), std::string::npos);
  EXPECT_NE(pipeline_schedule_error("1f1b", 2, 2, 3).find("multiple of the pipeline stages"), std::string::npos);
  EXPECT_NE(pipeline_schedule_error("gpipe", 2, 2, 4).find("interleaves"), std::string::npos);
  EXPECT_EQ(pipeline_schedule_error("1f1b", 4, 1, 1), "");
}

TEST(PipePartition, BalancedRunsAreContiguousNonEmptyAndMinimiseTheHeaviest) {
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(partition_balanced({10, 1, 1, 1, 1, 1}, 2), (std::vector<int64_t>{0, 1, 6}));
  EXPECT_EQ(partition_balanced({0, 1, 1, 1, 1, 0}, 4).size(), 5u);
  const auto b = partition_balanced({3, 1, 1, 1, 1, 1, 1, 3}, 4);
  for (size_t i = 0; i + 1 < b.size(); ++i) EXPECT_LT(b[i], b[i + 1]);
}

TEST(PipeGrid, MegatronOrderTensorInnermostStagesOutermost) {
  const GridShape g = make_grid_shape(8, 2, 2);
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(grid_coord(g, 5).tp_rank, 1);
  EXPECT_EQ(grid_coord(g, 5).dp_rank, 0);
  EXPECT_EQ(grid_coord(g, 5).pp_rank, 1);
  EXPECT_EQ(pp_group_members(g, 1), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(dp_group_members(g, 4), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(tp_group_members(g, 6), (std::vector<int64_t>{6, 7}));
  EXPECT_NE(input_error([] { make_grid_shape(6, 2, 2); }).find("does not divide the world size (6)"), std::string::npos);
}

// ---- configuration -----------------------------------------------------------------------------

TEST(PipeConfig, KeysFlagsAndTheBatchAtTheDataParallelSize) {
  json doc = {{"train_micro_batch_size_per_gpu", 2},
              {"gradient_accumulation_steps", 4},
              {"trainer", {{"env_type", "deepspeed"}, {"pipeline_parallel_size", 2}}},
              {"pipeline", {{"stages", "auto"}, {"partition", "type:Gpt2Block"}, {"activation_checkpoint_interval", 1},
                            {"pipe_partitioned", true}}}};
  const Config cfg = config_from_json(doc, "c.json", 8);
  EXPECT_EQ(cfg.trainer.pipeline_parallel_size, 2);
  EXPECT_EQ(cfg.batch.train_batch_size, 2 * 4 * 4);  // dp = 8 / 2
  EXPECT_EQ(cfg.pipeline.partition, "type:Gpt2Block");
  EXPECT_EQ(resolve_parallel_dims(cfg, 8).describe(), "pp 2 x tp 1 x dp 4, ZeRO-0");
  json staged = {{"train_batch_size", 16}, {"trainer", {{"env_type", "pytorchDDP"}}}, {"pipeline", {{"stages", 4}}}};
  EXPECT_EQ(config_from_json(staged, "s.json", 8).trainer.pipeline_parallel_size, 4);
  EXPECT_EQ(config_from_json(staged, "s.json", 8).batch.train_micro_batch_size_per_gpu, 8);
}

TEST(PipeConfig, OneLineErrorsNameTheKeyAndNumbers) {
  auto err = [](json doc, int64_t world) { return input_error([&] { config_from_json(doc, "p.json", world); }); };
  json base = {{"train_batch_size", 8}, {"trainer", {{"env_type", "pytorchDDP"}, {"pipeline_parallel_size", 3}}}};
  EXPECT_NE(err(base, 4).find("trainer.pipeline_parallel_size (3) does not divide the world size (4)"), std::string::npos)
      << err(base, 4);
  json single = {{"train_batch_size", 8}, {"trainer", {{"env_type", "pytorch"}, {"pipeline_parallel_size", 2}}}};
  EXPECT_NE(err(single, 2).find("needs env_type pytorchDDP, deepspeed or deepspeed+mpu"), std::string::npos);
  json both = {{"train_batch_size", 8},
               {"trainer", {{"env_type", "pytorchDDP"}, {"pipeline_parallel_size", 2}}},
               {"pipeline", {{"stages", 4}}}};
  EXPECT_NE(err(both, 4).find("pipeline.stages (4) and trainer.pipeline_parallel_size (2) disagree"), std::string::npos);
  json regex = {{"train_batch_size", 8}, {"pipeline", {{"partition", "type:[unclosed"}}}};
  EXPECT_NE(err(regex, 1).find("is not a regular expression"), std::string::npos) << err(regex, 1);
  json method = {{"train_batch_size", 8}, {"pipeline", {{"partition", "best"}}}};
  EXPECT_NE(err(method, 1).find("must be 'parameters', 'uniform' or 'type:REGEX'"), std::string::npos);
  json gpipe = {{"train_batch_size", 8}, {"pipeline", {{"schedule", "gpipe"}, {"virtual_stages", 2}}}};
  EXPECT_NE(err(gpipe, 1).find("has no interleaved form"), std::string::npos);
  json zb2 = {{"train_batch_size", 8},
              {"zero_optimization", {{"stage", 2}}},
              {"trainer", {{"env_type", "deepspeed"}, {"pipeline_parallel_size", 2}}},
              {"pipeline", {{"schedule", "zbh1"}}}};
  EXPECT_NE(input_error([&] { resolve_parallel_dims(config_from_json(zb2, "z.json", 2), 2); }).find("use stage 0 or 1"),
            std::string::npos);
  json interval = {{"train_batch_size", 8}, {"pipeline", {{"activation_checkpoint_interval", 2}}}};
  EXPECT_NE(err(interval, 1).find("only 0 (off) and 1"), std::string::npos);
  json zero3 = {{"train_batch_size", 8},
                {"zero_optimization", {{"stage", 3}}},
                {"trainer", {{"env_type", "deepspeed"}, {"pipeline_parallel_size", 2}}}};
  EXPECT_NE(input_error([&] { resolve_parallel_dims(config_from_json(zero3, "z.json", 2), 2); }).find("stage 0, 1 or 2"),
            std::string::npos);
}

// ---- point-to-point traffic over real ranks: the deadlock sweep ----------------------------------

namespace {

// A stack of residual MLP layers on [batch, length, 8]; the first takes the input "x", the last
// leaves the mean square as the loss. Each layer reads its own parameters; the last also reads the
// first's (a tied weight across the first and last stage).
struct Stack : torch::nn::Module, PipelinePlanned {
  explicit Stack(int64_t n) {
    for (int64_t i = 0; i < n; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
  }
  PipelinePlan pipeline_plan() override {
    PipelinePlan plan;
    for (size_t i = 0; i < layers.size(); ++i) {
      PipeLayer l;
      l.name = "l" + std::to_string(i);
      l.type = "Block";
      l.params = {"l" + std::to_string(i) + "."};
      const bool last = i + 1 == layers.size();
      if (last) l.params.push_back("l0.weight");
      auto layer = layers[i];
      auto first = layers[0];
      l.run = [layer, first, i, last](const TensorMap& in, TensorMap& carry) mutable {
        at::Tensor h = i == 0 ? in.at("x") : carry.at("h");
        h = h + torch::tanh(layer->forward(h));
        if (!last) {
          carry["h"] = h;
          carry["h2"] = h * 0.5;  // a second carry tensor with a gradient
          return;
        }
        h = h + carry.at("h2") + torch::matmul(h, first->weight);
        carry.clear();
        carry["loss"] = h.pow(2).mean();
      };
      plan.layers.push_back(std::move(l));
    }
    return plan;
  }
  std::vector<torch::nn::Linear> layers;
};

// Micro-batch m: 2 samples of length 3 + m % 4 (shapes change from one micro-batch to the next).
at::Tensor micro_input(int64_t m) {
  auto gen = at::detail::createCPUGenerator(77 + static_cast<uint64_t>(m));
  return torch::randn({2, 3 + m % 4, 8}, gen);
}

struct SweepRunner : MicroBatchRunner {
  int64_t next = 0, micro_batches = 1;
  at::Tensor forward(int64_t) override { throw InternalError("not used"); }
  std::map<std::string, at::Tensor> read(int64_t) override { return {{"x", micro_input(next++)}}; }
  at::Tensor weigh(const at::Tensor& loss, int64_t) override { return loss / static_cast<double>(micro_batches); }
};

// Every schedule, P stages, M = 1 .. 9: each stage's gradients equal one process's.
int sweep_rank(int rank, int P, int port) {
  auto comm = make_gloo_communicator(rank, P, "127.0.0.1", port, std::chrono::seconds(20));
  int failures = 0;
  const int64_t layers = 2 * P;
  for (const std::string kind : {"1f1b", "gpipe", "zbh1"})
    for (int64_t V : {1, 2})
      for (int64_t M = 1; M <= 9; ++M) {
        if (!pipeline_schedule_error(kind, P, V, M).empty()) continue;
        torch::manual_seed(5);
        auto ref = std::make_shared<Stack>(layers);
        torch::manual_seed(5);
        auto model = std::make_shared<Stack>(layers);
        for (int64_t m = 0; m < M; ++m) {
          const at::Tensor loss = run_pipeline_plan(ref->pipeline_plan(), {{"x", micro_input(m)}}) / static_cast<double>(M);
          loss.backward();
        }
        PipelineConfig pc;
        pc.schedule = kind;
        pc.virtual_stages = V;
        pc.partition = "uniform";
        PipelineStage stage(*comm, pc, M, c10::Device(c10::kCPU));
        stage.apply(*model);
        if (kind == "1f1b" && V == 1 && M == 1) {  // the run's layout line: two layers per stage
          std::string want = "pipeline: 1f1b, 1 micro-batches per step, partition uniform";
          for (int s = 0; s < P; ++s)
            want += " | stage " + std::to_string(s) + ": l" + std::to_string(2 * s) + " .. l" + std::to_string(2 * s + 1);
          want += " | fewer micro-batches than stages: every stage idles " + std::to_string((200 * (P - 1) + P) / (2 * P)) +
                  "% of the step; raise gradient_accumulation_steps to a few times " + std::to_string(P);
          if (stage.layout() != want) {
            std::fprintf(stderr, "rank %d: layout '%s', expected '%s'\n", rank, stage.layout().c_str(), want.c_str());
            ++failures;
          }
        }
        SweepRunner runner;
        runner.micro_batches = M;
        stage.run(runner, M, 2, [](const at::Tensor& loss, const MicroStep&) { loss.backward(); });
        // ZB-H1 really splits: past the first stage every micro-batch's B and W ran apart.
        if (kind == "zbh1" && rank > 0 && stage.stats().split_backwards != M) {
          std::fprintf(stderr, "rank %d zbh1 P %d M %ld: %ld split backwards\n", rank, P, static_cast<long>(M),
                       static_cast<long>(stage.stats().split_backwards));
          ++failures;
        }
        // The mirror's gradient was added through one more backward: the primary holds the sum.
        const auto refp = ref->named_parameters();
        for (const auto& p : model->named_parameters()) {
          if (!stage.trains(p.key())) continue;
          const at::Tensor want = refp[p.key()].grad();
          const double diff = (p.value().grad() - want).abs().max().item<double>();
          if (!(diff <= 1e-6 * std::max(1.0, want.abs().max().item<double>()))) {
            std::fprintf(stderr, "rank %d %s P %d V %ld M %ld: %s differs by %g\n", rank, kind.c_str(), P,
                         static_cast<long>(V), static_cast<long>(M), p.key().c_str(), diff);
            ++failures;
          }
        }
      }
  return failures == 0 ? 0 : 1;
}

}  // namespace

TEST(PipeP2P, EverySchedulePAndMicroBatchCountWithVaryingLengthsNeitherHangsNorMismatches) {
  for (int P : {2, 3, 4}) {
    const int port = free_port();
    std::fflush(nullptr);
    expect_ranks_pass(run_ranks(P, std::chrono::seconds(120), [&](int rank) { return sweep_rank(rank, P, port); }));
  }
}

// ---- the contract: the families cut into stages follow one process ---------------------------

namespace {

TpRun pp_run(int world, int pp, const char* env = "pytorchDDP") {
  TpRun r{world, 1};
  r.env = env;
  r.pp = pp;
  return r;
}

// 4 layers (so 4 stages have one each) and 4 micro-batches per step (so the pipeline fills).
TpRun deep(TpRun r) {
  r.layers = 4;
  r.accumulation = 4;
  return r;
}

}  // namespace

class PipeContract : public ::testing::TestWithParam<std::string> {};

// PP 2 and PP 4 of a 4-layer model over 4 micro-batches per step (1F1B), each stage's parameters
// trained where they live, the tied embeddings summed between the first and last stage.
TEST_P(PipeContract, Pp2AndPp4ReproduceOneProcessOver30Steps) {
  const TpRun one = deep(TpRun{1, 0}), two = deep(pp_run(2, 2)), four = deep(pp_run(4, 4));
  TpRun zb = deep(pp_run(2, 2));
  zb.schedule = "zbh1";
  TempDir tmp("pp_contract");
  train(GetParam(), tmp.path / "one", one);
  train(GetParam(), tmp.path / "pp2", two);
  train(GetParam(), tmp.path / "pp4", four);
  expect_same_run(tmp.path / "one", tmp.path / "pp2", 1e-5, GetParam() + " pp2");
  expect_same_run(tmp.path / "one", tmp.path / "pp4", 1e-5, GetParam() + " pp4");
  train(GetParam(), tmp.path / "zb", zb);
  expect_same_run(tmp.path / "one", tmp.path / "zb", 1e-5, GetParam() + " pp2 zbh1");
}

// PP 2 composed with each data-parallel strategy and with TP: PP 2 x DP 2 (replicated), PP 2 x TP 2
// (deepspeed+mpu), PP 2 x DP 2 with ZeRO-2 (which DeepSpeed's pipeline engine refuses).
TEST_P(PipeContract, Pp2WithDp2Tp2AndZero2ReproduceOneProcess) {
  TpRun dp = pp_run(4, 2);
  TpRun tp = pp_run(4, 2, "deepspeed+mpu");
  tp.tp = 2;
  TpRun zero = pp_run(4, 2, "deepspeed");
  zero.zero = 2;
  expect_runs_follow_one_process(GetParam(), "pp_compose", {{"pp2 x dp2", dp}, {"pp2 x tp2", tp}, {"pp2 x dp2 ZeRO-2", zero}});
}

INSTANTIATE_TEST_SUITE_P(Families, PipeContract, ::testing::Values("gpt2", "bert", "t5"));

// ALBERT's one shared layer group runs on every stage: trained on stage 0, mirrored on the others,
// its gradient summed there from every stage (with the SOP head on the last stage).
TEST(PipeAlbert, TheSharedLayerAcrossPp2AndPp4FollowsOneProcess) {
  const TpRun one = deep(TpRun{1, 0}), two = deep(pp_run(2, 2)), four = deep(pp_run(4, 4));
  TpRun zb = deep(pp_run(2, 2));
  zb.schedule = "zbh1";  // the shared layer applied twice per stage: each backward stays whole in B
  TempDir tmp("pp_albert");
  train("albert", tmp.path / "one", one);
  train("albert", tmp.path / "pp2", two);
  train("albert", tmp.path / "pp4", four);
  train("albert", tmp.path / "zb", zb);
  expect_same_run(tmp.path / "one", tmp.path / "pp2", 1e-5, "albert pp2");
  expect_same_run(tmp.path / "one", tmp.path / "zb", 1e-5, "albert pp2 zbh1");
  expect_same_run(tmp.path / "one", tmp.path / "pp4", 1e-5, "albert pp4");
}

// The other schedules and the partition methods give the same training (GPT-2, PP 2, 4 layers):
// GPipe, interleaved 1F1B with 2 chunks per stage, activation checkpointing per stage, ZB-H1.
TEST(PipeSchedules, GpipeInterleavedAndCheckpointedFollowOneProcess) {
  TpRun gpipe = pp_run(2, 2);
  gpipe.schedule = "gpipe";
  TpRun inter = pp_run(2, 2);
  inter.virtual_stages = 2;
  TpRun ckpt = pp_run(2, 2);
  ckpt.checkpoint_interval = 1;
  ckpt.partition = "type:Gpt2Block";
  TpRun zb = pp_run(4, 4);  // ZB-H1 at PP 4, and at PP 2 x DP 2 under ZeRO-1
  zb.schedule = "zbh1";
  TpRun zb_zero = pp_run(4, 2, "deepspeed");
  zb_zero.schedule = "zbh1";
  zb_zero.zero = 1;
  for (TpRun* r : {&gpipe, &inter, &ckpt, &zb, &zb_zero}) *r = deep(*r);
  expect_runs_follow_one_process("gpt2", "pp_schedules",
                                 {{"gpipe", gpipe}, {"interleaved V 2", inter}, {"checkpointed", ckpt}, {"zbh1 pp4", zb},
                                  {"zbh1 pp2 x dp2 ZeRO-1", zb_zero}});
}

// A checkpoint saved at step 15 by PP 2 resumes at PP 1 and at PP 4 (ZeRO-2) on the uninterrupted curve.
TEST(PipeCheckpoint, Pp2ResumesAtPp1AndPp4OnTheUninterruptedCurve) {
  TempDir tmp("pp_resume");
  TpRun ref{1, 0};
  ref.layers = 4;
  train("gpt2", tmp.path / "reference", ref);
  const auto want = losses(tmp.path / "reference");
  TpRun saver = pp_run(2, 2);
  saver.layers = 4;
  saver.steps = 15;
  saver.save_interval = 15;
  train("gpt2", tmp.path / "saved", saver);
  TpRun one{1, 0};
  one.layers = 4;
  TpRun four = pp_run(4, 4, "deepspeed");  // and from replicated optimizer state into ZeRO-2 partitions
  four.zero = 2;
  four.layers = 4;
  for (auto [name, run] : {std::pair<std::string, TpRun>{"pp1", one}, {"pp4", four}}) {
    run.steps = 30;
    train("gpt2", tmp.path / name, run, [&](Config& c) {
      c.trainer.load_dir = (tmp.path / "saved" / "ckpt").string();
      c.trainer.save_dir = (tmp.path / name / "ckpt").string();
    });
    const auto got = losses(tmp.path / name);
    ASSERT_EQ(got.size(), 15u) << name;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[15 + i], 1e-5 * want[15 + i]) << name << " step " << 16 + i;
  }
}

// ---- bad input ---------------------------------------------------------------------------------

namespace {

// Every rank of a `world`-process pipeline of `layers` layers must fail prepare() with a one-line
// InputError containing `expected`.
void expect_pipeline_error(int world, int pp, int64_t layers, const std::string& expected,
                           const std::function<void(Config&)>& edit = {}, const std::string& family = "gpt2") {
  TpRun r = pp_run(world, pp);
  r.layers = layers;
  expect_prepare_error(r, family, expected, edit, /*one_line=*/true);
}

}  // namespace

TEST(PipeErrors, MoreStagesThanLayers) {
  expect_pipeline_error(4, 4, 2, "trainer.pipeline_parallel_size 4 exceeds the model's 2 layers");
}

TEST(PipeErrors, APartitionThatLeavesAStageEmpty) {
  expect_pipeline_error(2, 2, 2, "pipeline.partition 'type:Bert' leaves stage", [](Config& c) { c.pipeline.partition = "type:Bert"; });
}

TEST(PipeErrors, VirtualStagesThatDoNotDivideTheLayers) {
  expect_pipeline_error(2, 2, 6, "pipeline.virtual_stages 2 does not divide the model's layers",
                        [](Config& c) { c.pipeline.virtual_stages = 2; });
}

// ALBERT's middle stages at PP 4 read only the shared layer, trained on stage 0: nothing for ZeRO
// to partition there (pytorchDDP runs them, PipeAlbert above).
TEST(PipeErrors, ZeroOnAStageWithoutParametersOfItsOwn) {
  expect_pipeline_error(4, 4, 4, "2 of the 4 pipeline stages train no parameter of their own", [](Config& c) {
    c.trainer.env_type = "deepspeed";
  }, "albert");
}

TEST(PipeErrors, FewerMicroBatchesThanStagesForInterleaving) {
  TempDir tmp("pp_error_micro");
  const int port = free_port();
  std::fflush(nullptr);
  auto status = run_ranks(4, std::chrono::seconds(60), [&](int rank) {
    TpRun r = pp_run(4, 4);
    r.layers = 8;
    r.virtual_stages = 2;
    r.steps = 1;
    try {
      Config cfg = run_config(tmp.path, r);
      make_backend(cfg, make_gloo_communicator(rank, 4, "127.0.0.1", port, std::chrono::seconds(30)));
    } catch (const InputError& e) {
      const std::string msg = e.what();
      if (msg.find("needs at least as many micro-batches per step (gradient_accumulation_steps, 2) as pipeline stages (4)") !=
          std::string::npos)
        return 0;
      std::fprintf(stderr, "rank %d: unexpected message: %s\n", rank, msg.c_str());
      return 1;
    }
    return 1;
  });
  expect_ranks_pass(status);
}
