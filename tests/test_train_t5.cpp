// train_t5 as a user runs it: the corpus SentencePiece model, span-corrupted batches of the
// real corpus, a short run of a tiny T5 whose train and eval losses fall, and bad input ->
// one `error:` line, exit 2.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "data/sentencepiece_tokenizer.h"
#include "helpers/process.h"

namespace fs = std::filesystem;

namespace {

struct RunResult {
  int code;
  std::string out;
};

RunResult run(const std::string& cmd) {
  RunResult r{0, ""};
  r.code = polytrain::testing::run_command("cd " POLYTRAIN_SOURCE_DIR " && " + cmd + " 2>&1", &r.out);
  return r;
}

const std::string kT5 = POLYTRAIN_BINARY_DIR "/train_t5";

bool assets_present() {
  return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/spm/corpus.model") &&
         fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/corpus/sherlock.txt");
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("pt_tt5_" + std::to_string(::getpid()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The numbers after `key` in the order printed ("eval_loss 7.1", "| loss 8.2 |").
std::vector<double> numbers_after(const std::string& out, const std::string& key) {
  std::vector<double> v;
  const std::regex re(key + " ([0-9.]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) v.push_back(std::stod((*it)[1]));
  return v;
}

}  // namespace

TEST(TrainT5, LossFallsOnTheCorpus) {
  if (!polytrain::SentencePieceTokenizer::available()) GTEST_SKIP() << "built without SentencePiece";
  if (!assets_present()) GTEST_SKIP() << "assets not fetched (scripts/fetch_assets.sh)";
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
  auto expect_error = [](const RunResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.out;
    int error_lines = 0;
    std::string last;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("error: ", 0) == 0) ++error_lines, last = line;
    EXPECT_EQ(error_lines, 1) << r.out;
    EXPECT_NE(last.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.out;
  };
  expect_error(run(kT5 + " --config configs/bert_tiny.json"), "train_t5 trains t5 models");
  expect_error(run(kT5 + " --config configs/t5_small.json --spm_model " + (tmp.path / "none.model").string()),
               "none.model");
  if (!polytrain::SentencePieceTokenizer::available() || !assets_present()) return;
  expect_error(run(kT5 + " --config configs/t5_small.json --noise_density 1.5"), "noise_density must be in (0, 1)");
  std::ofstream(tmp.path / "c.json") << R"({"train_batch_size": 8, "model": {"model_type": "t5", "vocab_size": 8000},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"]}})";
  expect_error(run(kT5 + " --config " + (tmp.path / "c.json").string()),
               "model.vocab_size 8000 is smaller than the vocabulary of");
}
