// train_albert as a user runs it: configs/albert_tiny.json on the real corpus, a short run whose
// train and eval losses fall, with the SOP part printed beside the total, a checkpoint that
// resumes to the same losses; the two shipped ALBERT configs through the real parser; and bad
// input -> one `error:` line, exit 2.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "polytrain/common/config.h"
#include "polytrain/models/albert_config.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace fs = std::filesystem;
using polytrain::testing::expect_one_line_error;
using polytrain::testing::numbers_after;
using polytrain::testing::TempDir;

namespace {

polytrain::testing::ProgramRun run(const std::string& cmd) { return polytrain::testing::run_program(cmd); }

const std::string kAlbert = POLYTRAIN_BINARY_DIR "/train_albert";
const fs::path kSource = POLYTRAIN_SOURCE_DIR;

bool assets_present() {
  return fs::exists(kSource / ".cache/assets/vocab/bert-base-uncased-vocab.txt") &&
         fs::exists(kSource / ".cache/assets/corpus/sherlock.txt");
}

// The step -> loss pairs of the log lines "step N/M | ... | loss X".
std::map<int64_t, std::string> step_losses(const std::string& out) {
  std::map<int64_t, std::string> m;
  const std::regex re("step ([0-9]+)/[0-9]+ \\|[^\\n]*\\| loss ([0-9.]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    m[std::stoll((*it)[1])] = (*it)[2];
  return m;
}

}  // namespace

TEST(AlbertConfigs, ShippedConfigsLoadWithTheRealParser) {
  const auto tiny = polytrain::load_config((kSource / "configs/albert_tiny.json").string());
  EXPECT_EQ(tiny.model.model_type, "albert");
  EXPECT_EQ(tiny.optimizer.type, "Lamb");
  EXPECT_EQ(tiny.trainer.env_type, "pytorch");
  const auto tiny_model = polytrain::albert_config_from_json(tiny.model.extra, "model");
  EXPECT_TRUE(tiny_model.sentence_order_prediction);
  EXPECT_EQ(tiny_model.vocab_size, 30522);
  EXPECT_LE(tiny.data.max_seq_length, tiny_model.max_position_embeddings);

  const auto large = polytrain::load_config((kSource / "configs/albert_large_hivemind.json").string());
  EXPECT_TRUE(large.ignored_keys.empty());
  const auto m = polytrain::albert_config_from_json(large.model.extra, "model");
  // albert-large-v2's config.json, but BERT's 30522-token WordPiece vocabulary.
  EXPECT_EQ(m.hidden_size, 1024);
  EXPECT_EQ(m.num_hidden_layers, 24);
  EXPECT_EQ(m.num_attention_heads, 16);
  EXPECT_EQ(m.intermediate_size, 4096);
  EXPECT_EQ(m.embedding_size, 128);
  EXPECT_EQ(m.max_position_embeddings, 512);
  EXPECT_EQ(m.hidden_act, "gelu_new");
  EXPECT_EQ(m.num_hidden_groups, 1);
  EXPECT_EQ(m.vocab_size, 30522);
  EXPECT_EQ(m.hidden_dropout_prob, 0.0);
  EXPECT_TRUE(m.sentence_order_prediction);
  // hivemind's examples/albert recipe (arguments.py, run_trainer.py).
  EXPECT_EQ(large.trainer.env_type, "hivemind");
  EXPECT_EQ(large.optimizer.type, "Lamb");
  EXPECT_DOUBLE_EQ(large.optimizer.lr, 0.00176);
  EXPECT_DOUBLE_EQ(large.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(large.optimizer.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(large.optimizer.clamp_value, 10000.0);
  EXPECT_TRUE(large.optimizer.bias_correction);
  EXPECT_EQ(large.scheduler.warmup_num_steps, 5000);
  EXPECT_EQ(large.scheduler.total_num_steps, 125000);
  EXPECT_DOUBLE_EQ(large.gradient_clipping, 1.0);
  EXPECT_EQ(large.batch.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(large.batch.gradient_accumulation_steps, 1);  // the swarm accumulates (hivemind's rule)
  EXPECT_EQ(large.data.max_seq_length, 512);
  EXPECT_EQ(large.hivemind.target_batch_size, 4096);
  EXPECT_EQ(large.hivemind.compression, "fp16");
  EXPECT_TRUE(large.fp16.enabled);
}

TEST(TrainAlbert, LossFallsSopIsReportedAndACheckpointResumes) {
  PT_SKIP_UNLESS(assets_present(), "the corpus and the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  // configs/albert_tiny.json for 60 of its 300 steps (~10 s on 2 cores), a checkpoint every 30.
  const std::string common = kAlbert + " --config configs/albert_tiny.json --no_progress_bar --num_threads 2"
                                       " --log_interval 10 --eval_interval 30 --save_interval 30 --max_steps 60"
                                       " --experiments_dir " +
                             (tmp.path / "exp").string() + " --save_dir " + (tmp.path / "ckpt").string();
  const auto r = run(common);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[CLS] A [SEP] B [SEP] = 128 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loss = MLM + SOP"), std::string::npos) << r.out;
  const auto train = numbers_after(r.out, "\\| loss"), eval = numbers_after(r.out, "eval_loss");
  ASSERT_EQ(train.size(), 6u) << r.out;
  ASSERT_EQ(eval.size(), 2u) << r.out;
  std::printf("train loss %.3f -> %.3f, eval loss %.3f -> %.3f\n", train.front(), train.back(), eval.front(),
              eval.back());
  EXPECT_GT(train.front(), 10.0) << "starts near ln(30522) + ln(2) = 11.0";
  EXPECT_LT(train.back(), train.front() - 1.0) << r.out;
  EXPECT_LT(eval.back(), eval.front() - 0.5) << r.out;

  // The SOP part: a train line per 10 micro-batches, an eval line per evaluation; the eval
  // parts add up to the Trainer's eval loss.
  const auto sop_train = numbers_after(r.out, "\\| sop_loss"), accuracy = numbers_after(r.out, "\\| sop_accuracy");
  ASSERT_EQ(sop_train.size(), 6u) << r.out;
  ASSERT_EQ(accuracy.size(), 6u) << r.out;
  for (double v : sop_train) EXPECT_TRUE(v > 0.1 && v < 2.0) << "a two-way cross-entropy: " << v;
  for (double v : accuracy) EXPECT_TRUE(v >= 0.0 && v <= 1.0) << v;
  EXPECT_NE(r.out.find("sop train | micro-batches 51-60 |"), std::string::npos) << r.out;
  const auto eval_mlm = numbers_after(r.out, "eval_mlm_loss"), eval_sop = numbers_after(r.out, "eval_sop_loss");
  ASSERT_EQ(eval_mlm.size(), 2u) << r.out;
  ASSERT_EQ(eval_sop.size(), 2u) << r.out;
  ASSERT_EQ(numbers_after(r.out, "eval_sop_accuracy").size(), 2u) << r.out;
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(eval_mlm[i] + eval_sop[i], eval[i], 2e-3) << r.out;

  // Resume from step 30 (`latest` pointed back at it): steps 40-60 log the same losses.
  ASSERT_TRUE(fs::exists(tmp.path / "ckpt" / "global_step30")) << r.out;
  ASSERT_TRUE(fs::exists(tmp.path / "ckpt" / "global_step60")) << r.out;
  std::ofstream(tmp.path / "ckpt" / "latest") << "global_step30";
  const auto again = run(common + " --experiment_name resumed --load_dir " + (tmp.path / "ckpt").string());
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("at step 30"), std::string::npos) << again.out;
  const auto first = step_losses(r.out), second = step_losses(again.out);
  ASSERT_EQ(second.size(), 3u) << again.out;
  for (const int64_t step : {40, 50, 60}) EXPECT_EQ(second.at(step), first.at(step)) << "step " << step;
}

TEST(TrainAlbert, InspectBatchesShowsBothOrders) {
  PT_SKIP_UNLESS(assets_present(), "the corpus and the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  const auto r = run(kAlbert + " --config configs/albert_tiny.json --inspect_batches 4");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::regex swapped_line("swapped ([0-9]+) of 64 samples");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, swapped_line)) << r.out;
  const int swapped = std::stoi(m[1]);
  EXPECT_GT(swapped, 16) << r.out;
  EXPECT_LT(swapped, 48) << r.out;
  EXPECT_NE(r.out.find("sentence_order_label 1: B A"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sentence_order_label 0: A B"), std::string::npos) << r.out;
}

TEST(TrainAlbert, BadInputIsOneLineExitTwo) {
  expect_one_line_error(run(kAlbert + " --config configs/bert_tiny.json"), "train_albert trains albert models");
  PT_SKIP_UNLESS(assets_present(), "the corpus and the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir tmp;
  std::ofstream(tmp.path / "small_vocab.json") << R"({"train_batch_size": 8,
    "model": {"model_type": "albert", "vocab_size": 30000, "hidden_size": 64, "num_attention_heads": 2,
              "intermediate_size": 128},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"],
             "vocab_file": ".cache/assets/vocab/bert-base-uncased-vocab.txt"}})";
  expect_one_line_error(run(kAlbert + " --config " + (tmp.path / "small_vocab.json").string()),
                        "model.vocab_size 30000 is smaller than the vocabulary");
  std::ofstream(tmp.path / "long.json") << R"({"train_batch_size": 8,
    "model": {"model_type": "albert", "vocab_size": 30522, "hidden_size": 64, "num_attention_heads": 2,
              "intermediate_size": 128, "max_position_embeddings": 64},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"], "max_seq_length": 128,
             "vocab_file": ".cache/assets/vocab/bert-base-uncased-vocab.txt"}})";
  expect_one_line_error(run(kAlbert + " --config " + (tmp.path / "long.json").string()),
                        "exceeds model.max_position_embeddings");
}
