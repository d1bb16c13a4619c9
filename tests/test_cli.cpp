// The programs as a user runs them: train_bert on the real corpus (20 steps, save, resume),
// --print_config, --inspect_batches, and bad input of every kind -> one `error:` line, exit 2,
// nothing overwritten.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace fs = std::filesystem;

namespace {

// A type of this file's own, so that its stricter expect_one_line_error below (no "terminate
// called" either) is the one calls find, not program.h's through argument-dependent lookup.
struct Run {
  int code;
  std::string out;  // stdout + stderr
};

Run run(const std::string& cmd) {
  auto r = polytrain::testing::run_program(cmd);
  return {r.code, std::move(r.out)};
}

const std::string kBert = POLYTRAIN_BINARY_DIR "/train_bert";
const std::string kConfig = "configs/bert_tiny.json";

bool assets_present() {
  return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt");
}

using polytrain::testing::TempDir;

// Exactly one line, starting with "error: " and containing `needle`.
void expect_one_line_error(const Run& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.out;
  std::string last;
  int lines = 0, error_lines = 0;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    ++lines;
    if (line.rfind("error: ", 0) == 0) ++error_lines, last = line;
  }
  EXPECT_EQ(error_lines, 1) << r.out;
  EXPECT_NE(last.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

}  // namespace

TEST(Cli, PrintConfigIsResolvedJson) {
  auto r = run(kBert + " --config " + kConfig + " --print_config --max_steps 7");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["trainer"]["max_steps"], 7);
  EXPECT_EQ(j["train_batch_size"], 16);
  EXPECT_EQ(j["model"]["hidden_size"], 128);
}

TEST(Cli, BadInputIsOneLineExitTwo) {
  TempDir tmp;
  expect_one_line_error(run(kBert + " --config " + tmp.write("bad.json", "{\n  \"train_batch_size\": 8,\n  oops\n}")),
                        "bad.json:3");
  expect_one_line_error(run(kBert + " --config " + tmp.write("typo.json", R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}})")),
                        "weight_decay");
  expect_one_line_error(run("WORLD_SIZE=2 " + kBert + " --config " + tmp.write("batch.json", R"({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17, "gradient_accumulation_steps": 2})")),
                        "train_batch_size");
  expect_one_line_error(run(kBert + " --config " + kConfig + " --train_files /nonexistent/book.txt"),
                        "/nonexistent/book.txt");
  expect_one_line_error(run(kBert + " --config " + tmp.path.string() + "/missing.json"), "missing.json");
  expect_one_line_error(run(kBert + " --config " + kConfig + " --no_such_flag"), "no_such_flag");
  expect_one_line_error(run(kBert + " --config " + kConfig + " --max_steps abc"), "max_steps");
  expect_one_line_error(run(kBert + " --config " + kConfig + " --env_type nonsense"), "env_type");
  if (assets_present())
    expect_one_line_error(run(kBert + " --config " + kConfig + " --max_steps 1 --load_dir " + tmp.path.string() + "/none"),
                          "/none");
}

TEST(Cli, TrainsSavesAndResumesOnTheRealCorpus) {
  PT_SKIP_UNLESS(assets_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  const std::string common = kBert + " --config " + kConfig + " --no_progress_bar --log_interval 10 --eval_interval 0 --experiments_dir " +
                             (tmp.path / "exp").string() + " --save_dir " + (tmp.path / "ckpt").string();
  auto first = run(common + " --max_steps 20 --save_interval 10");
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_NE(first.out.find("step 20/20"), std::string::npos) << first.out;
  ASSERT_TRUE(fs::exists(tmp.path / "ckpt" / "global_step20" / "state.pt"));

  auto second = run(common + " --max_steps 30 --load_dir " + (tmp.path / "ckpt").string());
  ASSERT_EQ(second.code, 0) << second.out;
  EXPECT_NE(second.out.find("resumed from"), std::string::npos) << second.out;
  EXPECT_NE(second.out.find("step 30/30"), std::string::npos) << second.out;

  // A corrupt checkpoint is refused with one line, and nothing in the folder changes.
  const fs::path state = tmp.path / "ckpt" / "global_step30" / "state.pt";
  fs::resize_file(state, fs::file_size(state) / 2);
  const auto before = fs::last_write_time(tmp.path / "ckpt" / "latest");
  auto bad = run(common + " --max_steps 40 --load_dir " + (tmp.path / "ckpt").string());
  expect_one_line_error(bad, "state.pt");
  EXPECT_EQ(fs::last_write_time(tmp.path / "ckpt" / "latest"), before);
}

TEST(Cli, InspectBatchesShowsMasking) {
  PT_SKIP_UNLESS(assets_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  auto r = run(kBert + " --config " + kConfig + " --inspect_batches 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("=== batch 1 ==="), std::string::npos) << r.out;
  auto pos = r.out.find("mask rate ");
  ASSERT_NE(pos, std::string::npos) << r.out;
  const double rate = std::stod(r.out.substr(pos + 10));
  EXPECT_NEAR(rate, 0.15, 0.02);
}
