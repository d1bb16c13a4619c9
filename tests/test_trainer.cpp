// The Trainer loop with env_type=pytorch on a tiny BERT and a synthetic, learnable MLM source:
// loss falls, gradient accumulation, non-finite steps skipped, bit-exact resume, the experiment
// folder's files, and checkpoints that survive corruption and a kill during save.
#include <cstdlib>

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/models/bert.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/pattern_source.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
namespace fs = std::filesystem;

namespace {

class TestTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  int64_t poison_call = -1;  // forward_step call whose loss becomes inf
  int64_t calls = 0;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto out = dynamic_cast<BertForMaskedLMImpl&>(model).forward(
        batch.at("input_ids"), batch.at("attention_mask"), batch.at("token_type_ids"), batch.at("labels"));
    if (calls++ == poison_call && model.is_training()) out.loss = out.loss * std::numeric_limits<double>::infinity();
    return out;
  }
};

using polytrain::testing::PatternSource;
using polytrain::testing::TempDir;
using polytrain::testing::tiny_config;


TrainResult run(const Config& cfg, std::vector<at::Tensor>* params = nullptr, int64_t poison = -1,
                const BatchSource* eval = nullptr) {
  PatternSource train(256);
  TestTrainer trainer(cfg);
  trainer.poison_call = poison;
  BertForMaskedLM model(cfg.model);
  auto r = trainer.train(model.ptr(), train, eval);
  if (params) {
    params->clear();
    for (auto& p : model->parameters()) params->push_back(p.detach().clone());
  }
  return r;
}

}  // namespace

TEST(Trainer, LossFalls) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path);
  cfg.trainer.max_steps = 200;
  cfg.trainer.eval_interval = 0;
  auto r = run(cfg);
  ASSERT_EQ(r.losses.size(), 200u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += r.losses[i], last += r.losses[195 + i];
  EXPECT_LT(last, first * 0.8) << "first5 " << first / 5 << " last5 " << last / 5;
}

TEST(Trainer, GradientAccumulationMatchesOneBigBatch) {
  TempDir tmp;
  auto a_cfg = tiny_config(tmp.path, 0.0);
  auto b_cfg = a_cfg;
  b_cfg.batch = {8, 4, 2, 1};
  std::vector<at::Tensor> pa, pb;
  auto a = run(a_cfg, &pa), b = run(b_cfg, &pb);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5 * a.losses[i]);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-4, 2e-5)) << i << " max diff " << (pa[i] - pb[i]).abs().max().item<double>();
}

TEST(Trainer, NonFiniteStepIsSkipped) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.0);
  cfg.trainer.max_steps = 3;
  cfg.trainer.eval_interval = 0;
  std::vector<at::Tensor> poisoned;
  auto r = run(cfg, &poisoned, /*poison=*/1);  // the second forward: step 2 gets an inf loss
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(r.steps, 3);
  ASSERT_EQ(r.losses.size(), 3u);
  EXPECT_FALSE(std::isfinite(r.losses[1]));
  EXPECT_TRUE(std::isfinite(r.losses[2]));
  for (auto& p : poisoned) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

// bf16 (DeepSpeed's bf16.enabled): the forward runs under CPU autocast in bf16, the parameters
// stay fp32 master weights, and the model still learns.
TEST(Trainer, Bf16TrainsOnCpuWithFp32MasterWeights) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.0);
  cfg.trainer.max_steps = 150;
  cfg.trainer.eval_interval = 0;
  auto fp32 = run(cfg);
  cfg.bf16.enabled = true;
  std::vector<at::Tensor> params;
  auto bf16 = run(cfg, &params);
  ASSERT_EQ(bf16.losses.size(), 150u);
  double first = 0, last = 0, max_rel = 0;
  for (int i = 0; i < 5; ++i) first += bf16.losses[i], last += bf16.losses[145 + i];
  EXPECT_LT(last, first * 0.8) << "first5 " << first / 5 << " last5 " << last / 5;
  for (size_t i = 0; i < 150; ++i) max_rel = std::max(max_rel, std::abs(bf16.losses[i] / fp32.losses[i] - 1));
  EXPECT_GT(max_rel, 0.0) << "bf16 gave the fp32 losses bit for bit: autocast did not run";
  EXPECT_LT(std::abs(bf16.losses[0] / fp32.losses[0] - 1), 0.02);  // same start, to bf16 rounding
  for (auto& p : params) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

// On a CPU without native bf16 (or with POLYTRAIN_CPU_BF16=0, which this test sets), bf16 would
// be slower than fp32 or fail: the trainer trains in fp32 instead, bit for bit, and says why.
// (ctest sets POLYTRAIN_CPU_BF16=1 for the other tests, so that they test bf16 on any CPU.)
TEST(Trainer, Bf16FallsBackToFp32WithALineWhereTheCpuHasNoNativeBf16) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.0);
  cfg.trainer.max_steps = 3;
  cfg.trainer.eval_interval = 0;
  auto fp32 = run(cfg);
  cfg.bf16.enabled = true;
  const char* before = std::getenv("POLYTRAIN_CPU_BF16");
  const std::string saved = before ? before : "";
  ::setenv("POLYTRAIN_CPU_BF16", "0", 1);
  ::testing::internal::CaptureStdout();
  auto fallen = run(cfg);
  const std::string out = ::testing::internal::GetCapturedStdout();
  if (before) ::setenv("POLYTRAIN_CPU_BF16", saved.c_str(), 1); else ::unsetenv("POLYTRAIN_CPU_BF16");
  EXPECT_NE(out.find("bf16: training in fp32 instead: POLYTRAIN_CPU_BF16=0"), std::string::npos) << out;
  ASSERT_EQ(fallen.losses.size(), fp32.losses.size());
  for (size_t i = 0; i < fp32.losses.size(); ++i) EXPECT_EQ(fallen.losses[i], fp32.losses[i]) << i;
}

TEST(Trainer, Fp16NeedsCuda) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.0);
  cfg.fp16.enabled = true;
  try {
    run(cfg);
    FAIL() << "fp16 on CPU trained";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fp16.enabled needs a CUDA device"), std::string::npos) << e.what();
  }
}

// fp16 on a GPU: an injected overflow skips the step and lowers the dynamic scale (hysteresis
// 1), the other steps train, the parameters stay finite fp32.
TEST(Trainer, Fp16OverflowSkipsTheStepAndLowersTheScaleOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA (no GPU visible)";
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.0);
  cfg.trainer.pytorch_device = "cuda";
  cfg.trainer.max_steps = 4;
  cfg.trainer.eval_interval = 0;
  cfg.fp16.enabled = true;
  cfg.fp16.initial_scale_power = 10;
  cfg.fp16.hysteresis = 1;
  std::vector<at::Tensor> params;
  auto r = run(cfg, &params, /*poison=*/1);
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(r.loss_scale, 512.0);
  EXPECT_FALSE(std::isfinite(r.losses[1]));
  for (size_t i : {0u, 2u, 3u}) EXPECT_TRUE(std::isfinite(r.losses[i])) << i;
  for (auto& p : params) {
    EXPECT_EQ(p.scalar_type(), at::kFloat);
    EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  }
}

// trainer.checkpoint_activations (FlagAI) and an activation_checkpointing block (DeepSpeed)
// switch it on; training is then the same, bit for bit, dropout included.
TEST(Trainer, ActivationCheckpointingTrainsIdentically) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path, 0.1);
  cfg.trainer.max_steps = 6;
  cfg.trainer.eval_interval = 0;
  std::vector<at::Tensor> plain, flag, block;
  auto a = run(cfg, &plain);
  cfg.trainer.checkpoint_activations = true;
  auto b = run(cfg, &flag);
  cfg.trainer.checkpoint_activations = false;
  cfg.activation_checkpointing_present = true;
  auto c = run(cfg, &block);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.losses, c.losses);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i], flag[i])) << i;
    EXPECT_TRUE(torch::equal(plain[i], block[i])) << i;
  }
}

TEST(Trainer, ResumeIsBitExact) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path);  // dropout on: the RNG state must be restored too
  cfg.trainer.eval_interval = 0;
  std::vector<at::Tensor> full_params, resumed_params;
  auto full = run(cfg, &full_params);

  auto first = cfg;
  first.trainer.max_steps = 4;
  first.trainer.save_dir = (tmp.path / "ckpt").string();
  run(first);
  auto second = cfg;
  second.trainer.load_dir = first.trainer.save_dir;
  second.trainer.save_dir = (tmp.path / "ckpt2").string();
  auto resumed = run(second, &resumed_params);
  ASSERT_EQ(resumed.losses.size(), 6u);
  EXPECT_EQ(resumed.steps, 10);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed.losses[i], full.losses[4 + i]) << "step " << 5 + i;
  ASSERT_EQ(full_params.size(), resumed_params.size());
  for (size_t i = 0; i < full_params.size(); ++i) EXPECT_TRUE(torch::equal(full_params[i], resumed_params[i])) << i;
}

TEST(Trainer, ExperimentFolderHoldsTheRecord) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path);
  cfg.trainer.experiment_name = "exp1";
  cfg.trainer.save_safetensors = true;
  PatternSource eval(32);
  auto r = run(cfg, nullptr, -1, &eval);
  const fs::path dir = r.experiment_dir;
  EXPECT_EQ(dir.filename(), "exp1");
  const std::string parent = dir.parent_path().filename().string();
  EXPECT_EQ(parent.rfind("train.", 0), 0u) << parent;
  for (auto f : {"hparams.json", "githash.log", "gitdiff.log", "metrics.jsonl"}) EXPECT_TRUE(fs::exists(dir / f)) << f;
  bool events = false;
  for (auto& e : fs::directory_iterator(dir / "tensorboard"))
    events |= e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_TRUE(events);
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  int train_records = 0, eval_records = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) {
      ++train_records;
      for (auto k : {"step", "lr", "samples_per_second"}) EXPECT_TRUE(j.contains(k)) << k;
    }
    if (j.contains("eval_loss")) ++eval_records;
  }
  EXPECT_EQ(train_records, 2);
  EXPECT_EQ(eval_records, 2);
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "global_step10" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "best" / "state.pt"));
  EXPECT_EQ(latest_checkpoint_tag((dir / "checkpoints").string()), "global_step10");
}

TEST(Checkpoint, CorruptionIsDetected) {
  TempDir tmp;
  auto cfg = tiny_config(tmp.path);
  cfg.trainer.max_steps = 2;
  cfg.trainer.eval_interval = 0;
  cfg.trainer.save_dir = (tmp.path / "ckpt").string();
  run(cfg);
  const fs::path state = tmp.path / "ckpt" / "global_step2" / "state.pt";
  auto resume = cfg;
  resume.trainer.load_dir = cfg.trainer.save_dir;
  resume.trainer.save_dir = (tmp.path / "other").string();
  resume.trainer.max_steps = 3;
  {  // flip one byte in the middle
    std::fstream f(state, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(state) / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(state) / 2));
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  try {
    run(resume);
    FAIL() << "corrupt checkpoint loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  fs::resize_file(state, fs::file_size(state) - 100);
  EXPECT_THROW(run(resume), InputError);
  resume.trainer.load_dir = (tmp.path / "nowhere").string();
  EXPECT_THROW(run(resume), InputError);
}

TEST(Checkpoint, KillDuringSaveLeavesPreviousLoadable) {
  TempDir tmp;
  const std::string dir = (tmp.path / "ckpt").string();
  auto write = [&](const std::string& tag, int64_t value, bool die_in_fill, bool die_in_extra) {
    write_checkpoint(
        dir, tag, {{"step", value}},
        [&](torch::serialize::OutputArchive& a) {
          if (die_in_fill) ::kill(::getpid(), SIGKILL);
          a.write("x", torch::full({1000}, static_cast<double>(value)));
        },
        true,
        [&](const std::string& tmp_dir) {
          if (!die_in_extra) return;
          std::ofstream(tmp_dir + "/partial.bin") << std::string(1 << 20, 'x');
          ::kill(::getpid(), SIGKILL);
        });
  };
  write("global_step1", 1, false, false);
  for (int point = 0; point < 2; ++point) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      write("global_step2", 2, point == 0, point == 1);
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status));
    EXPECT_EQ(latest_checkpoint_tag(dir), "global_step1");
    at::Tensor x;
    auto meta = read_checkpoint(dir, "global_step1", [&](torch::serialize::InputArchive& a) { a.read("x", x); });
    EXPECT_EQ(meta["step"], 1);
    EXPECT_EQ(x[0].item<double>(), 1.0);
  }
  // A later complete save works and replaces `latest`.
  write("global_step2", 2, false, false);
  EXPECT_EQ(latest_checkpoint_tag(dir), "global_step2");
}
