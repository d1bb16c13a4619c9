// What a run says and leaves behind: the summary line before the first step (console and
// metrics.jsonl), tokens/s and elapsed time on step lines, a resumed run appending to its
// experiment folder, readable folder names, no folder left by a run that fails before its first
// step, the 0-step run's done line, a checkpoint save that runs out of space (RLIMIT_FSIZE with
// SIGXFSZ ignored: EFBIG, handled as ENOSPC), the note of an interrupted run, and the tokenizer
// files --save_hf writes (and an export without training).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <set>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"
#include "polytrain/models/bert.h"
#include "polytrain/trainer/interrupt_note.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/pattern_source.h"
#include "helpers/program.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
namespace fs = std::filesystem;
using polytrain::testing::PatternSource;
using polytrain::testing::TempDir;
using polytrain::testing::tiny_config;

namespace {

// Runs `hook(call)` before each forward_step call (the disk-full test lowers the file-size
// limit from inside the run).
class HookedTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  std::function<void(int64_t)> hook;
  int64_t calls = 0;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    if (hook) hook(calls);
    ++calls;
    return dynamic_cast<BertForMaskedLMImpl&>(model).forward(batch.at("input_ids"), batch.at("attention_mask"),
                                                              batch.at("token_type_ids"), batch.at("labels"));
  }
};

struct TrainRun {
  TrainResult result;
  std::string out;  // stdout of the run
};

TrainRun train(const Config& cfg, std::function<void(int64_t)> hook = {}) {
  PatternSource data(256);
  ::testing::internal::CaptureStdout();
  TrainRun r;
  try {
    HookedTrainer trainer(cfg);
    trainer.hook = std::move(hook);
    BertForMaskedLM model(cfg.model);
    r.result = trainer.train(model.ptr(), data);
  } catch (...) {
    r.out = ::testing::internal::GetCapturedStdout();
    throw;
  }
  r.out = ::testing::internal::GetCapturedStdout();
  return r;
}

std::vector<nlohmann::json> jsonl(const fs::path& file) {
  std::vector<nlohmann::json> v;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) v.push_back(nlohmann::json::parse(line));
  return v;
}

std::vector<fs::path> entries(const fs::path& dir) {
  std::vector<fs::path> v;
  if (fs::exists(dir))
    for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path());
  return v;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Config small_run(const fs::path& root) {
  Config cfg = tiny_config(root);
  cfg.trainer.experiment_name = "exp";
  cfg.trainer.max_steps = 4;
  cfg.trainer.log_interval = 2;
  cfg.trainer.eval_interval = 0;
  cfg.trainer.save_interval = 2;
  return cfg;
}

}  // namespace

TEST(RunReport, SummaryLineBeforeTheFirstStepAndTokensOnStepLines) {
  TempDir tmp;
  const TrainRun r = train(small_run(tmp.path));
  const fs::path exp = r.result.experiment_dir;
  // One line: env_type, grid, engine, parameters, tokens per step (global batch 8 x 16 tokens),
  // and the three paths, before the first step line.
  const std::string want = "run: env_type pytorch | world 1 = tp 1 x pp 1 x dp 1 | comm none (one process) | ";
  const size_t at = r.out.find(want);
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("run: ", at + 1), std::string::npos) << "one summary line: " << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find(" | 128 tokens/step (8 x 16) | experiment " + exp.string() + " | checkpoints " +
                      (exp / "checkpoints").string() + " | tensorboard " + (exp / "tensorboard").string()),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("K parameters"), std::string::npos) << line;
  EXPECT_EQ(line.find("ZeRO"), std::string::npos) << "no ZeRO under pytorch: " << line;
  EXPECT_LT(at, r.out.find("step 2/4")) << r.out;
  // Step lines: tokens/s (16 tokens per sample) and elapsed time.
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(step 2/4 \|.* samples/s \| [0-9]+ tokens/s \| elapsed [0-9.]+s)")))
      << r.out;
  // metrics.jsonl: the summary record first, then step records with tokens_per_second.
  const auto records = jsonl(exp / "metrics.jsonl");
  ASSERT_GE(records.size(), 3u);
  ASSERT_TRUE(records[0].contains("run")) << records[0];
  const auto& run = records[0]["run"];
  EXPECT_EQ(run["env_type"], "pytorch");
  EXPECT_EQ(run["tokens_per_step"], 128);
  EXPECT_EQ(run["global_batch"], 8);
  EXPECT_EQ(run["comm"], "none (one process)");
  EXPECT_EQ(run["experiment_dir"], exp.string());
  EXPECT_EQ(run["continued"], false);
  BertForMaskedLM model(small_run(tmp.path).model);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  EXPECT_EQ(run["parameters"], params);
  ASSERT_TRUE(records[1].contains("tokens_per_second")) << records[1];
  EXPECT_NEAR(records[1]["tokens_per_second"].get<double>(), records[1]["samples_per_second"].get<double>() * 16, 1e-6);
  EXPECT_GT(records[1]["elapsed_s"].get<double>(), 0.0);
}

TEST(RunReport, ReadableFolderNamesWithASuffixOnlyOnACollision) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  cfg.trainer.max_steps = 1;
  cfg.trainer.save_interval = 0;
  const std::regex name(R"(train\.\d{4}\.\d\d\.\d\d\.\d\d\.\d\d\.\d\d\.exp(\.[0-9]+)?)");
  std::set<std::string> parents;
  for (int i = 0; i < 3; ++i) {
    const fs::path exp = train(cfg).result.experiment_dir;
    EXPECT_EQ(exp.filename(), "exp");
    const std::string parent = exp.parent_path().filename().string();
    EXPECT_TRUE(std::regex_match(parent, name)) << parent;
    parents.insert(parent);
  }
  EXPECT_EQ(parents.size(), 3u) << "three runs, three folders";
}

TEST(RunReport, AResumedRunAppendsToItsExperimentFolder) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  const TrainRun first = train(cfg);
  const fs::path exp = first.result.experiment_dir;
  // The checkpoint records its experiment folder.
  const CheckpointReader ck((exp / "checkpoints").string(), "global_step4");
  EXPECT_EQ(ck.meta()["experiment_dir"], fs::absolute(exp).lexically_normal().string());

  Config again = cfg;
  again.trainer.load_dir = first.result.save_dir;
  again.trainer.max_steps = 8;
  const TrainRun second = train(again);
  EXPECT_EQ(second.result.experiment_dir, first.result.experiment_dir);
  EXPECT_EQ(second.result.save_dir, first.result.save_dir);
  EXPECT_EQ(entries(tmp.path / "experiments").size(), 1u) << "one run folder";
  EXPECT_NE(second.out.find("| experiment " + exp.string() + " (continued) |"), std::string::npos) << second.out;
  // One metrics.jsonl with both runs' steps, in order, and two summary records.
  std::vector<int64_t> steps;
  int summaries = 0;
  for (const auto& rec : jsonl(exp / "metrics.jsonl")) {
    if (rec.contains("run")) ++summaries;
    if (rec.contains("loss")) steps.push_back(rec["step"].get<int64_t>());
  }
  EXPECT_EQ(summaries, 2);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4, 6, 8}));
  EXPECT_EQ(latest_checkpoint_tag(first.result.save_dir), "global_step8");

  // Another experiment_name starts a folder of its own.
  Config other = again;
  other.trainer.max_steps = 9;
  other.trainer.experiment_name = "other";
  other.trainer.save_dir = (tmp.path / "ckpt_other").string();
  EXPECT_NE(train(other).result.experiment_dir, first.result.experiment_dir);
}

TEST(RunReport, AZeroStepRunSaysSoInsteadOfANanLoss) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  const TrainRun first = train(cfg);
  Config again = cfg;
  again.trainer.load_dir = first.result.save_dir;  // at step 4 already, max_steps 4
  const TrainRun second = train(again);
  EXPECT_TRUE(second.result.losses.empty());
  EXPECT_EQ(second.result.steps, 4);
  const std::string done = second.result.done_line();
  EXPECT_EQ(done.find("nan"), std::string::npos) << done;
  EXPECT_NE(done.find("done: 4 steps, no step left to take (already at step 4; raise --max_steps to train further)"),
            std::string::npos)
      << done;
  EXPECT_EQ(first.result.done_line().rfind("done: 4 steps, final loss ", 0), 0u) << first.result.done_line();
}

TEST(RunReport, ARunThatFailsBeforeItsFirstStepLeavesNoFolder) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  fs::create_directories(tmp.path / "empty_ckpt");
  cfg.trainer.load_dir = (tmp.path / "empty_ckpt").string();  // no `latest`: resume fails
  cfg.trainer.save_dir = (tmp.path / "elsewhere").string();
  try {
    train(cfg);
    FAIL() << "resume from a folder without 'latest' succeeded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("has no 'latest' file"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(entries(tmp.path / "experiments").empty()) << "a folder was left behind";
}

// A checkpoint save past the file-size limit: the .tmp folder is removed, the error states
// the bytes needed and free, and the previous checkpoint and `latest` stay loadable.
TEST(RunReport, OutOfSpaceDuringASaveRemovesTheTmpFolderAndSaysWhatItNeeds) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);  // saves at steps 2 and 4
  cfg.trainer.save_dir = (tmp.path / "ckpt").string();
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);
  std::string message;
  try {
    // Step 3's first forward: from now on no file may grow past 64 KiB (state.pt is bigger;
    // metrics.jsonl and the events file stay below).
    train(cfg, [](int64_t call) {
      if (call != 2) return;
      struct rlimit lim {};
      ::getrlimit(RLIMIT_FSIZE, &lim);
      lim.rlim_cur = 64 * 1024;
      ::setrlimit(RLIMIT_FSIZE, &lim);
    });
  } catch (const InputError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, previous_handler);
  ASSERT_FALSE(message.empty()) << "the save past the limit succeeded";
  const std::string ckpt = (tmp.path / "ckpt").string();
  EXPECT_NE(message.find("checkpoint " + ckpt + "/global_step4: out of space writing state.pt (File too large: past "
                         "this process's file-size limit, ulimit -f): the checkpoint needs about "),
            std::string::npos)
      << message;
  EXPECT_TRUE(std::regex_search(message, std::regex("the last complete checkpoint global_step2 holds [0-9]+\\)")))
      << message;
  EXPECT_TRUE(std::regex_search(message, std::regex("the file system of " + ckpt + " has [0-9]+ bytes \\([0-9.]+ MB\\) free")))
      << message;
  EXPECT_NE(message.find("removed " + ckpt + "/global_step4.tmp, the previous checkpoint and 'latest' are unchanged; "
                         "free space, or save elsewhere with --save_dir"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(tmp.path / "ckpt" / "global_step4.tmp"));
  EXPECT_FALSE(fs::exists(tmp.path / "ckpt" / "global_step4"));
  EXPECT_EQ(latest_checkpoint_tag(ckpt), "global_step2");
  const CheckpointReader ck(ckpt, "global_step2");
  EXPECT_NO_THROW(ck.read("state.pt"));
  // The number: at least the previous checkpoint's files.
  uint64_t previous = 0;
  for (const auto& [name, rec] : ck.meta()["files"].items()) previous += rec["size"].get<uint64_t>();
  EXPECT_NE(message.find("needs about " + std::to_string(previous) + " bytes"), std::string::npos) << message;
  // The run had taken steps: its experiment folder stays.
  EXPECT_EQ(entries(tmp.path / "experiments").size(), 1u);
}

namespace {

struct Interrupted {
  int status = 0;
  std::string err;
};

// Forks a long training run (stderr to a file), sends it `sig` once `ready` holds, and returns
// how it ended and what it wrote.
Interrupted interrupt_run(const Config& cfg, const fs::path& dir, int sig, const std::function<bool()>& ready) {
  const fs::path err = dir / "stderr.txt", out = dir / "stdout.txt";
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::freopen(err.c_str(), "w", stderr);
    std::freopen(out.c_str(), "w", stdout);
    at::set_num_threads(1);
    try {
      PatternSource data(256);
      HookedTrainer trainer(cfg);
      BertForMaskedLM model(cfg.model);
      trainer.train(model.ptr(), data);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(3);
  }
  Interrupted r;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool sent = false;
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &r.status, WNOHANG) == pid) {
      r.err = slurp(err);
      ADD_FAILURE() << "the run ended before it was interrupted: " << r.err << slurp(out);
      return r;
    }
    if (ready()) {
      ::kill(pid, sig);
      sent = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!sent) {
    ::kill(pid, SIGKILL);
    ADD_FAILURE() << "the run never got ready: " << slurp(out) << slurp(err);
  }
  ::waitpid(pid, &r.status, 0);
  r.err = slurp(err);
  return r;
}

}  // namespace

TEST(RunReport, AnInterruptedRunNamesItsLastCheckpointAndTheResumeFlag) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  cfg.trainer.max_steps = 100000;
  cfg.trainer.save_dir = (tmp.path / "ckpt").string();
  const std::string ckpt = cfg.trainer.save_dir;
  // Once global_step6 exists, global_step4's save has been noted.
  const auto r = interrupt_run(cfg, tmp.path, SIGTERM, [&] { return fs::exists(fs::path(ckpt) / "global_step6"); });
  ASSERT_TRUE(WIFSIGNALED(r.status)) << "status " << r.status << ": " << r.err;
  EXPECT_EQ(WTERMSIG(r.status), SIGTERM) << "the default action still ends it (exit status 143 from a shell)";
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m,
                                std::regex("interrupted at step ([0-9]+): last complete checkpoint " + ckpt +
                                           "/global_step([0-9]+); resume with --load_dir " + ckpt + "\n")))
      << r.err;
  const int64_t step = std::stoll(m[1]), saved = std::stoll(m[2]);
  EXPECT_GE(saved, 4);
  EXPECT_GE(step, saved);
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / ("global_step" + std::to_string(saved)) / "complete.json"));
}

TEST(RunReport, AnInterruptedRunWithoutACheckpointSaysSo) {
  TempDir tmp;
  Config cfg = small_run(tmp.path);
  cfg.trainer.max_steps = 100000;
  cfg.trainer.save_interval = 0;
  cfg.trainer.log_interval = 1;
  const fs::path out = tmp.path / "stdout.txt";
  const auto r = interrupt_run(cfg, tmp.path, SIGINT, [&] { return slurp(out).find("step 2/") != std::string::npos; });
  ASSERT_TRUE(WIFSIGNALED(r.status)) << "status " << r.status << ": " << r.err;
  EXPECT_EQ(WTERMSIG(r.status), SIGINT);
  EXPECT_TRUE(std::regex_search(r.err, std::regex("\ninterrupted at step [0-9]+: no checkpoint was saved yet "
                                                  "\\(nothing to resume\\)\n")))
      << r.err;
}

TEST(RunReport, TheInterruptNoteLeavesAnIgnoredSignalIgnoredAndRestoresTheHandler) {
  const auto before_int = ::signal(SIGINT, SIG_IGN);
  struct sigaction term_before {};
  ::sigaction(SIGTERM, nullptr, &term_before);
  {
    InterruptNote note(true);
    struct sigaction now {};
    ::sigaction(SIGINT, nullptr, &now);
    EXPECT_EQ(now.sa_handler, SIG_IGN);
    ::sigaction(SIGTERM, nullptr, &now);
    EXPECT_NE(now.sa_handler, term_before.sa_handler);
    note.set_step(12);
    EXPECT_EQ(interrupt_note_text(), "\ninterrupted at step 12: no checkpoint was saved yet (nothing to resume)\n");
    note.set_checkpoint("out/ckpt", "global_step10");
    EXPECT_EQ(interrupt_note_text(),
              "\ninterrupted at step 12: last complete checkpoint out/ckpt/global_step10; resume with --load_dir out/ckpt\n");
  }
  struct sigaction after {};
  ::sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, term_before.sa_handler);
  ::signal(SIGINT, before_int);
}

namespace {

bool gpt2_assets() { return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/gpt2/encoder.json"); }

// A one-layer GPT-2 on one book (its paths resolve from the source tree, where programs run).
void write_tiny_gpt2_config(const fs::path& file) {
  std::ofstream(file) << R"({
    "train_batch_size": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {"model_type": "gpt2", "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"], "vocab_file": ".cache/assets/gpt2/encoder.json",
             "max_seq_length": 32, "eval_fraction": 0.0}})";
}

}  // namespace

// --save_hf writes the tokenizer next to the weights; the same command with a checkpoint that
// has nothing left to train exports it without training.
TEST(RunReport, SaveHfWritesTheTokenizerAndExportsACheckpointWithoutTraining) {
  if (!gpt2_assets()) GTEST_SKIP() << "the GPT-2 BPE files in .cache/assets (scripts/fetch_assets.sh)";
  TempDir tmp;
  write_tiny_gpt2_config(tmp.path / "c.json");
  const std::string common = POLYTRAIN_BINARY_DIR "/train_gpt2 --config " + (tmp.path / "c.json").string() +
                             " --no_progress_bar --num_threads 1 --experiments_dir " + (tmp.path / "exp").string() +
                             " --save_dir " + (tmp.path / "ckpt").string();
  const auto trained = polytrain::testing::run_program(common + " --max_steps 2 --save_hf " + (tmp.path / "hf").string());
  ASSERT_EQ(trained.code, 0) << trained.out;
  const fs::path assets = fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/gpt2";
  EXPECT_EQ(slurp(tmp.path / "hf" / "vocab.json"), slurp(assets / "encoder.json"));
  EXPECT_EQ(slurp(tmp.path / "hf" / "merges.txt"), slurp(assets / "vocab.bpe"));
  const auto tok = nlohmann::json::parse(slurp(tmp.path / "hf" / "tokenizer_config.json"));
  EXPECT_EQ(tok["tokenizer_class"], "GPT2Tokenizer");
  EXPECT_EQ(tok["model_max_length"], 32);
  EXPECT_NE(trained.out.find("saved HF model and tokenizer (vocab.json, merges.txt) to "), std::string::npos);

  // Export: the checkpoint is at step 2, --max_steps 1 leaves nothing to train.
  const auto exported =
      polytrain::testing::run_program(common + " --load_dir " + (tmp.path / "ckpt").string() +
                                      " --max_steps 1 --save_hf " + (tmp.path / "hf2").string());
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find("done: 2 steps, no step left to take"), std::string::npos) << exported.out;
  EXPECT_EQ(exported.out.find("nan"), std::string::npos) << exported.out;
  EXPECT_EQ(exported.out.find("step 1/"), std::string::npos) << "it trained: " << exported.out;
  for (const char* f : {"model.safetensors", "config.json", "vocab.json", "merges.txt", "tokenizer_config.json"})
    EXPECT_EQ(slurp(tmp.path / "hf2" / f), slurp(tmp.path / "hf" / f)) << f;
}

// The program as a user meets a full disk (here its file-size limit, `ulimit -f`, with SIGXFSZ
// ignored as a shell's trap leaves it): one error line, exit code 2, no half-written checkpoint.
TEST(RunReport, AProgramOutOfSpaceExitsTwoWithOneLineAndNoTmpFolder) {
  if (!gpt2_assets()) GTEST_SKIP() << "the GPT-2 BPE files in .cache/assets (scripts/fetch_assets.sh)";
  TempDir tmp;
  write_tiny_gpt2_config(tmp.path / "c.json");
  // 4 MiB: the experiment folder's files fit (its gitdiff.log too), the checkpoint's state.pt (~6.5 MB) does not.
  const auto r = polytrain::testing::run_program(
      "trap '' XFSZ; ulimit -f 4096; exec " POLYTRAIN_BINARY_DIR "/train_gpt2 --config " + (tmp.path / "c.json").string() +
      " --no_progress_bar --num_threads 1 --max_steps 1 --experiments_dir " + (tmp.path / "exp").string() +
      " --save_dir " + (tmp.path / "ckpt").string());
  polytrain::testing::expect_one_line_error(r, "global_step1: out of space writing ");
  EXPECT_NE(r.out.find("removed " + (tmp.path / "ckpt" / "global_step1.tmp").string()), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp.path / "ckpt" / "global_step1.tmp")) << r.out;
  EXPECT_FALSE(fs::exists(tmp.path / "ckpt" / "latest")) << r.out;
}

// BERT: vocab.txt is the WordPiece vocabulary in id order (the asset's lines) with
// do_lower_case as the run tokenized; T5: spiece.model is the SentencePiece model it used.
TEST(RunReport, SaveHfWritesVocabTxtForBertAndSpieceModelForT5) {
  const fs::path assets = fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets";
  if (!fs::exists(assets / "vocab/bert-base-uncased-vocab.txt") || !fs::exists(assets / "spm/corpus.model"))
    GTEST_SKIP() << "the vocab and SentencePiece assets in .cache/assets (scripts/fetch_assets.sh)";
  TempDir tmp;
  std::ofstream(tmp.path / "bert.json") << R"({
    "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 64},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"],
             "vocab_file": ".cache/assets/vocab/bert-base-uncased-vocab.txt", "max_seq_length": 32,
             "eval_fraction": 0.0}})";
  const std::string flags = " --no_progress_bar --num_threads 1 --max_steps 1 --experiments_dir " +
                            (tmp.path / "exp").string() + " --save_hf ";
  const auto bert = polytrain::testing::run_program(POLYTRAIN_BINARY_DIR "/train_bert --config " +
                                                    (tmp.path / "bert.json").string() + flags + (tmp.path / "bert").string());
  ASSERT_EQ(bert.code, 0) << bert.out;
  EXPECT_EQ(slurp(tmp.path / "bert" / "vocab.txt"), slurp(assets / "vocab/bert-base-uncased-vocab.txt"));
  const auto bert_tok = nlohmann::json::parse(slurp(tmp.path / "bert" / "tokenizer_config.json"));
  EXPECT_EQ(bert_tok["tokenizer_class"], "BertTokenizer");
  EXPECT_EQ(bert_tok["do_lower_case"], true);
  EXPECT_EQ(bert_tok["model_max_length"], 64);
  EXPECT_TRUE(fs::exists(tmp.path / "bert" / "model.safetensors"));

  std::ofstream(tmp.path / "t5.json") << R"({
    "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {"model_type": "t5", "vocab_size": 8100, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 1,
              "num_heads": 2},
    "data": {"train_files": [".cache/assets/corpus/sherlock.txt"], "max_seq_length": 32, "eval_fraction": 0.0}})";
  const auto t5 = polytrain::testing::run_program(POLYTRAIN_BINARY_DIR "/train_t5 --config " +
                                                  (tmp.path / "t5.json").string() + flags + (tmp.path / "t5").string());
  if (t5.out.find("SentencePiece") != std::string::npos && t5.code != 0) GTEST_SKIP() << t5.out;
  ASSERT_EQ(t5.code, 0) << t5.out;
  EXPECT_EQ(slurp(tmp.path / "t5" / "spiece.model"), slurp(assets / "spm/corpus.model"));
  const auto t5_tok = nlohmann::json::parse(slurp(tmp.path / "t5" / "tokenizer_config.json"));
  EXPECT_EQ(t5_tok["tokenizer_class"], "T5Tokenizer");
  EXPECT_EQ(t5_tok["extra_ids"], 100);
}
