// train_gpt2 as a user runs it: BPE on the real corpus, a short run whose loss falls, the HF
// directory it writes loads back (--init_from), and bad input -> one `error:` line, exit 2.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace fs = std::filesystem;
using polytrain::testing::expect_one_line_error;

namespace {

polytrain::testing::ProgramRun run(const std::string& cmd) { return polytrain::testing::run_program(cmd); }

const std::string kGpt2 = POLYTRAIN_BINARY_DIR "/train_gpt2";

bool assets_present() {
  return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/gpt2/encoder.json");
}

using polytrain::testing::TempDir;

std::vector<double> eval_losses(const std::string& out) { return polytrain::testing::numbers_after(out, "eval_loss"); }

}  // namespace

TEST(TrainGpt2, LossFallsOnTheCorpusAndTheHfDirectoryLoadsBack) {
  PT_SKIP_UNLESS(assets_present(), "the GPT-2 BPE files in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  // configs/gpt2_tiny.json made smaller (one layer, 64-token blocks) to keep the test short.
  std::ofstream(tmp.path / "c.json") << R"({
    "train_batch_size": 8, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "model": {"model_type": "gpt2", "n_positions": 64, "n_embd": 64, "n_layer": 1, "n_head": 2},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"], "vocab_file": ".cache/assets/gpt2/encoder.json",
             "max_seq_length": 64, "eval_fraction": 0.02, "eval_batches": 2}})";
  const std::string common = kGpt2 + " --config " + (tmp.path / "c.json").string() +
                             " --no_progress_bar --num_threads 2 --log_interval 10 --save_interval 0 --experiments_dir " +
                             (tmp.path / "exp").string();
  auto r = run(common + " --save_dir " + (tmp.path / "ckpt").string() + " --max_steps 30 --eval_interval 15 --save_hf " + (tmp.path / "hf").string());
  ASSERT_EQ(r.code, 0) << r.out;
  auto losses = eval_losses(r.out);
  ASSERT_GE(losses.size(), 2u) << r.out;
  std::printf("eval loss %.3f -> %.3f\n", losses.front(), losses.back());
  EXPECT_LT(losses.back(), losses.front() - 0.3) << r.out;
  ASSERT_TRUE(fs::exists(tmp.path / "hf" / "model.safetensors"));
  ASSERT_TRUE(fs::exists(tmp.path / "hf" / "config.json"));
  // Starting from the saved weights: the first evaluation is already near the trained loss.
  auto again = run(common + " --max_steps 1 --eval_interval 1 --experiment_name again --save_dir " +
                   (tmp.path / "ckpt2").string() + " --init_from " + (tmp.path / "hf").string());
  ASSERT_EQ(again.code, 0) << again.out;
  auto resumed = eval_losses(again.out);
  ASSERT_FALSE(resumed.empty()) << again.out;
  EXPECT_LT(resumed.front(), losses.front() - 0.3) << again.out;
}

TEST(TrainGpt2, BadInputIsOneLineExitTwo) {
  TempDir tmp;
  expect_one_line_error(run(kGpt2 + " --config configs/bert_tiny.json"), "train_gpt2 trains gpt2 models");
  std::ofstream(tmp.path / "c.json") << R"({"train_batch_size": 8, "model": {"model_type": "gpt2", "n_embd": 30, "n_head": 4}})";
  expect_one_line_error(run(kGpt2 + " --config " + (tmp.path / "c.json").string()), "'n_embd' (30) must be divisible by n_head (4)");
  if (!assets_present()) return;
  expect_one_line_error(run(kGpt2 + " --config configs/gpt2_tiny.json --init_from " + (tmp.path / "nowhere").string()),
                        "nowhere/config.json: cannot read");
}

// env_type deepspeed+mpu through the launcher: configs/gpt2_tp2.json at 4 ranks is TP 2 x DP 2
// on CPU over Gloo; the exported HF directory is the whole model and loads in one process.
TEST(TrainGpt2, TensorParallelTwoByTwoThroughTheLauncher) {
  PT_SKIP_UNLESS(assets_present(), "the GPT-2 BPE files in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  const std::string launch = POLYTRAIN_BINARY_DIR "/launch --master_port " + std::to_string(20000 + ::getpid() % 20000);
  auto r = run("OMP_NUM_THREADS=1 " + launch + " --num_gpus 4 " + kGpt2 +
               " --config configs/gpt2_tp2.json --max_steps 4 --log_interval 2 --eval_interval 0 --save_interval 0 "
               "--no_progress_bar --experiments_dir " + (tmp.path / "exp").string() + " --save_dir " +
               (tmp.path / "ckpt").string() + " --save_hf " + (tmp.path / "hf").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 4/4"), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(tmp.path / "hf" / "model.safetensors")) << r.out;
  auto one = run(kGpt2 + " --config configs/gpt2_tiny.json --max_steps 1 --eval_interval 1 --save_interval 0 "
                 "--no_progress_bar --num_threads 2 --experiments_dir " + (tmp.path / "exp1").string() +
                 " --save_dir " + (tmp.path / "ckpt1").string() + " --init_from " + (tmp.path / "hf").string());
  EXPECT_EQ(one.code, 0) << one.out;
}

// FlagAI's deepspeed+mpu with a ZeRO config: configs/gpt2_tp2_zero2.json at 4 ranks is TP 2 x DP 2
// with ZeRO-2 and the optimizer offloaded to the CPU; its checkpoint resumes in one process
// under env_type pytorch (the universal layout) and training goes on from step 4.
TEST(TrainGpt2, TensorParallelTimesZero2OffloadThroughTheLauncherResumesInOneProcess) {
  PT_SKIP_UNLESS(assets_present(), "the GPT-2 BPE files in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  const std::string launch = POLYTRAIN_BINARY_DIR "/launch --master_port " + std::to_string(20000 + ::getpid() % 20000);
  const std::string common = " --config configs/gpt2_tp2_zero2.json --log_interval 2 --eval_interval 0 --save_interval 4 "
                             "--no_progress_bar --experiments_dir " + (tmp.path / "exp").string();
  auto r = run("OMP_NUM_THREADS=1 " + launch + " --num_gpus 4 " + kGpt2 + common + " --max_steps 4 --save_dir " +
               (tmp.path / "ckpt").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 4/4"), std::string::npos) << r.out;
  auto one = run(kGpt2 + common + " --max_steps 6 --env_type pytorch --model_parallel_size 1 --num_threads 2 --load_dir " +
                 (tmp.path / "ckpt").string() + " --save_dir " + (tmp.path / "ckpt1").string());
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_NE(one.out.find("resumed from"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("at step 4"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("step 6/6"), std::string::npos) << one.out;
}

TEST(TrainGpt2, TensorParallelBadInputIsOneLineExitTwo) {
  TempDir tmp;
  const std::string common = " --no_progress_bar --experiments_dir " + (tmp.path / "exp").string();
  // One process cannot hold a TP 2 group.
  expect_one_line_error(run(kGpt2 + " --config configs/gpt2_tp2.json" + common),
                        "model_parallel_size (2) does not divide the world size (1)");
  // TP needs env_type deepspeed+mpu.
  expect_one_line_error(run(kGpt2 + " --config configs/gpt2_tiny.json --model_parallel_size 2" + common),
                        "tensor parallelism needs env_type");
  EXPECT_FALSE(fs::exists(tmp.path / "exp"));
}
