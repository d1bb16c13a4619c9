// train_t5 as a user runs it: the corpus SentencePiece model, span-corrupted batches of the
// real corpus, a short run of a tiny T5 whose train and eval losses fall, and bad input ->
// one `error:` line, exit 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "polytrain/data/sentencepiece_tokenizer.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace fs = std::filesystem;
using polytrain::testing::expect_one_line_error;
using polytrain::testing::numbers_after;
using RunResult = polytrain::testing::ProgramRun;

namespace {

RunResult run(const std::string& cmd) { return polytrain::testing::run_program(cmd); }

const std::string kT5 = POLYTRAIN_BINARY_DIR "/train_t5";

bool assets_present() {
  return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/spm/corpus.model") &&
         fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/corpus/sherlock.txt");
}

using polytrain::testing::TempDir;

}  // namespace

TEST(TrainT5, LossFallsOnTheCorpus) {
  PT_SKIP_UNLESS(polytrain::SentencePieceTokenizer::available(), "SentencePiece in this build (Debian libsentencepiece-dev, then re-run cmake)");
  PT_SKIP_UNLESS(assets_present(), "the corpus and its SentencePiece model in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  // configs/t5_small.json made tiny: one layer each side, 32-token inputs, one book.
  std::ofstream(tmp.path / "c.json") << R"({
    "train_batch_size": 8, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "model": {"model_type": "t5", "vocab_size": 8100, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 1,
              "num_heads": 2, "dropout_rate": 0.0},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"], "max_seq_length": 32, "eval_fraction": 0.02,
             "eval_batches": 4},
    "trainer": {"seed": 7}})";
  const auto r = run(kT5 + " --config " + (tmp.path / "c.json").string() +
                     " --no_progress_bar --num_threads 2 --max_steps 24 --log_interval 4 --eval_interval 12"
                     " --save_interval 0 --experiments_dir " + (tmp.path / "exp").string() + " --save_dir " +
                     (tmp.path / "ckpt").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // 32-token inputs come from 34 raw tokens (5 noise in 2 spans): targets 5 + 2 + 1.
  EXPECT_NE(r.out.find("blocks of 34 -> inputs 32, targets 8"), std::string::npos) << r.out;
  const auto train = numbers_after(r.out, "\\| loss"), eval = numbers_after(r.out, "eval_loss");
  ASSERT_EQ(train.size(), 6u) << r.out;
  ASSERT_EQ(eval.size(), 2u) << r.out;
  std::printf("train loss %.3f -> %.3f, eval loss %.3f -> %.3f\n", train.front(), train.back(), eval.front(),
              eval.back());
  EXPECT_GT(train.front(), 8.0) << "starts near ln(8100) = 9.0";
  EXPECT_LT(train.back(), train.front() - 1.0) << r.out;
  EXPECT_LT(eval.back(), eval.front()) << r.out;
}

TEST(TrainT5, BadInputIsOneLineExitTwo) {
  TempDir tmp;
  expect_one_line_error(run(kT5 + " --config configs/bert_tiny.json"), "train_t5 trains t5 models");
  expect_one_line_error(run(kT5 + " --config configs/t5_small.json --spm_model " + (tmp.path / "none.model").string()),
               "none.model");
  PT_SKIP_UNLESS(polytrain::SentencePieceTokenizer::available(), "SentencePiece in this build (Debian libsentencepiece-dev, then re-run cmake)");
  PT_SKIP_UNLESS(assets_present(), "the corpus and its SentencePiece model in .cache/assets (scripts/fetch_assets.sh)");
  expect_one_line_error(run(kT5 + " --config configs/t5_small.json --noise_density 1.5"), "noise_density must be in (0, 1)");
  std::ofstream(tmp.path / "c.json") << R"({"train_batch_size": 8, "model": {"model_type": "t5", "vocab_size": 8000},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"]}})";
  expect_one_line_error(run(kT5 + " --config " + (tmp.path / "c.json").string()),
               "model.vocab_size 8000 is smaller than the vocabulary of");
}
