// The config as a newcomer meets it (issue 44): input paths in a config file resolve against its
// folder (then the current directory) and an unreadable one names its key, path and folders; a
// batch mismatch proposes values that work; every config error of a run in one InputError, each
// once; near-miss model keys warned about; FlagAI's Trainer names as trainer keys.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "helpers/program.h"
#include "helpers/temp_dir.h"
#include "polytrain/common/cli_config.h"
#include "polytrain/common/config.h"
#include "polytrain/common/config_keys.h"
#include "polytrain/common/config_paths.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::TempDir;

// The InputError's message ("" when none was thrown); any other exception fails the test.
template <class F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Runs the test body from `dir`, and returns to where it was.
class InDir {
 public:
  explicit InDir(const fs::path& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ~InDir() { fs::current_path(old_); }

 private:
  fs::path old_;
};

const json kBatch = {{"train_batch_size", 4}};

// ---- 1. paths -------------------------------------------------------------------------------

TEST(ConfigPaths, RelativePathsInAFileResolveAgainstItsFolderFromAnyDirectory) {
  TempDir project("pt_paths_project"), elsewhere("pt_paths_cwd");
  fs::create_directories(project.path / "configs");
  fs::create_directories(project.path / "assets");
  project.write("assets/book.txt", "Call me Ishmael.\n");
  project.write("assets/vocab.txt", "[PAD]\n");
  const std::string config = project.write("configs/run.json", json({{"train_batch_size", 4},
      {"data", {{"train_files", {"../assets/book.txt"}}, {"vocab_file", "../assets/vocab.txt"}}}}).dump());
  InDir cd(elsewhere.path);
  const Config cfg = load_config(config, 1);
  ASSERT_EQ(cfg.data.train_files.size(), 1u);
  EXPECT_EQ(cfg.data.train_files[0], (project.path / "assets/book.txt").string());
  EXPECT_EQ(cfg.data.vocab_file, (project.path / "assets/vocab.txt").string());
}

TEST(ConfigPaths, APathFoundOnlyInTheCurrentDirectoryStaysAsGiven) {
  TempDir project("pt_paths_project"), cwd("pt_paths_cwd");
  cwd.write("book.txt", "text\n");
  const std::string config =
      project.write("run.json", json({{"train_batch_size", 4}, {"data", {{"train_files", {"book.txt"}}}}}).dump());
  InDir cd(cwd.path);
  EXPECT_EQ(load_config(config, 1).data.train_files, std::vector<std::string>{"book.txt"});
}

TEST(ConfigPaths, AMissingFileNamesItsKeyIndexPathAndBothFolders) {
  TempDir project("pt_paths_project"), cwd("pt_paths_cwd");
  project.write("a.txt", "text\n");
  const std::string config = project.write(
      "run.json", json({{"train_batch_size", 4}, {"data", {{"train_files", {"a.txt", "missing/b.txt"}}}}}).dump());
  InDir cd(cwd.path);
  json doc = json::parse(std::ifstream(config));
  const auto errors = prepare_config_sources(doc, config, json::object());
  const std::string e = input_error([&] { config_from_json_with(doc, config, 1, errors); });
  EXPECT_NE(e.find(config + ": 'data.train_files[1]': 'missing/b.txt' is neither in the config file's folder (" +
                   project.str() + ") nor in the current directory (" + fs::current_path().string() + ")"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("train_files[0]"), std::string::npos) << e;  // the one that exists is fine
}

TEST(ConfigPaths, ADirectoryOrAnUnreadableFileIsNamedAsSuch) {
  TempDir project("pt_paths_project");
  fs::create_directories(project.path / "corpus");
  json doc = {{"train_batch_size", 4}, {"data", {{"train_files", {"corpus"}}}}};
  const auto errors = prepare_config_sources(doc, project.str("run.json"), json::object());
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "'data.train_files[0]': cannot read '" + project.str("corpus") +
                           "' (found in the config file's folder): is a directory, not a file");
}

TEST(ConfigPaths, CommandLinePathsAreTheCurrentDirectorysAndReplaceTheFiles) {
  TempDir project("pt_paths_project"), cwd("pt_paths_cwd");
  cwd.write("mine.txt", "text\n");
  json file = {{"train_batch_size", 4}, {"data", {{"train_files", {"gone.txt"}}, {"vocab_file", "gone.vocab"}}}};
  const json overrides = {{"data", {{"train_files", {"mine.txt"}}, {"vocab_file", "v.txt"}}}};
  InDir cd(cwd.path);
  const auto errors = prepare_config_sources(file, project.str("run.json"), overrides);
  // the file's two paths are replaced by the flags, so only the flags' missing one is reported
  ASSERT_EQ(errors.size(), 1u) << errors[0];
  EXPECT_EQ(errors[0], "'data.vocab_file' (command line): cannot read 'v.txt': No such file or directory (paths on "
                       "the command line are relative to the current directory, " + fs::current_path().string() + ")");
  const Config cfg = config_from_json_with(apply_overrides(file, overrides, 1), "run.json + command line", 1, {});
  EXPECT_EQ(cfg.data.train_files, std::vector<std::string>{"mine.txt"});
}

TEST(ConfigPaths, UnreadableFilesAreReportedWithTheOtherErrors) {
  const std::string e = input_error([&] {
    config_from_json_with(json({{"train_batch_size", 4}, {"trainer", {{"epochs", -1}}}}), "run.json", 1,
                          {"'data.vocab_file': cannot read 'x': No such file or directory"});
  });
  EXPECT_EQ(lines_of(e), (std::vector<std::string>{"run.json: 'data.vocab_file': cannot read 'x': No such file or directory",
                                                   "run.json: 'trainer.epochs' must be >= 0, got -1"}));
}

TEST(ConfigPaths, OutputFoldersAreLeftToTheCurrentDirectory) {
  TempDir project("pt_paths_project");
  json doc = {{"train_batch_size", 4},
              {"trainer", {{"save_dir", "ck"}, {"experiments_dir", "exp"}, {"load_dir", "old"}}},
              {"tensorboard", {{"output_path", "tb"}}},
              {"hivemind", {{"identity_path", "id.key"}}}};
  const json before = doc;
  EXPECT_TRUE(prepare_config_sources(doc, project.str("run.json"), json::object()).empty());
  EXPECT_EQ(doc, before);
}

// ---- 2. batch sizes that work ---------------------------------------------------------------

TEST(ConfigBatchFix, AMismatchProposesValuesForThisWorld) {
  const std::string e = input_error([] {
    config_from_json(json({{"train_batch_size", 16}, {"train_micro_batch_size_per_gpu", 16},
                           {"gradient_accumulation_steps", 1}}),
                     "gpt2_tiny.json", 3);
  });
  EXPECT_EQ(e,
            "gpt2_tiny.json: batch sizes disagree: train_batch_size (16) != train_micro_batch_size_per_gpu (16) * "
            "gradient_accumulation_steps (1) * world_size (3) = 48; values that work at world_size 3: "
            "train_batch_size 48 (= train_micro_batch_size_per_gpu 16 x gradient_accumulation_steps 1 x world_size 3), "
            "or train_batch_size 15 with train_micro_batch_size_per_gpu 5 and gradient_accumulation_steps 1, "
            "or train_batch_size 18 with train_micro_batch_size_per_gpu 6 and gradient_accumulation_steps 1");
}

TEST(ConfigBatchFix, ADivisibleGlobalBatchKeepsItAndSplitsItPerRank) {
  const std::string e = input_error([] {
    config_from_json(json({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4},
                           {"gradient_accumulation_steps", 1}}),
                     "c.json", 2);
  });
  EXPECT_NE(e.find("train_batch_size 8 (= train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x "
                   "world_size 2), or train_batch_size 32 with train_micro_batch_size_per_gpu 4 and "
                   "gradient_accumulation_steps 4"),
            std::string::npos)
      << e;
  // and the proposal does work
  EXPECT_EQ(config_from_json(json({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4},
                                   {"gradient_accumulation_steps", 4}}), "c.json", 2).batch.train_batch_size, 32);
}

TEST(ConfigBatchFix, DerivationsThatDoNotDivideProposeTheNearestGlobalBatches) {
  const std::string e = input_error([] {
    config_from_json(json({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 6}}), "c.json", 2);
  });
  EXPECT_NE(e.find("is not divisible by train_micro_batch_size_per_gpu (6) * world_size (2); values that work at "
                   "world_size 2: train_batch_size 24 or 36"),
            std::string::npos)
      << e;
  const std::string tp = input_error([] {
    config_from_json(json({{"train_batch_size", 5}, {"trainer", {{"env_type", "deepspeed+mpu"}, {"model_parallel_size", 2}}}}),
                     "c.json", 4);
  });
  EXPECT_NE(tp.find("values that work at data-parallel size 2: train_batch_size 4 or 6"), std::string::npos) << tp;
}

TEST(ConfigBatchFix, NoBatchSizeSaysHowToGiveOne) {
  const std::string e = input_error([] { config_from_json(json::object(), "command line", 1); });
  EXPECT_EQ(e, "command line: no batch size given: pass --config FILE (configs/ has examples), or --train_batch_size N "
               "(global) or --batch_size N (per process); in a config file, give 'train_batch_size' or "
               "'train_micro_batch_size_per_gpu' (DeepSpeed needs one of them)");
}

// ---- 3. all errors in one pass --------------------------------------------------------------

TEST(ConfigAllErrors, EachSectionsErrorIsReportedOnceInOneInputError) {
  const json doc = {{"train_batch_size", 16},
                    {"train_micro_batch_size_per_gpu", 16},
                    {"gradient_accumulation_steps", 1},
                    {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", -1}}}}},
                    {"fp16", {{"enabled", true}}},
                    {"bf16", {{"enabled", true}}},
                    {"trainer", {{"max_step", 10}}}};
  const std::string e = input_error([&] { config_from_json(doc, "run.json", 3); });
  const auto lines = lines_of(e);
  ASSERT_EQ(lines.size(), 4u) << e;
  EXPECT_EQ(lines[0], "run.json: 'optimizer.params.lr' must be >= 0, got -1");
  EXPECT_EQ(lines[1], "run.json: 'fp16.enabled' and 'bf16.enabled' are both true; pick one");
  EXPECT_EQ(lines[2], "run.json: unknown key 'trainer.max_step' (did you mean 'max_steps'?)");
  EXPECT_EQ(lines[3].rfind("run.json: batch sizes disagree: train_batch_size (16)", 0), 0u) << lines[3];
}

TEST(ConfigAllErrors, TheSameMessageFromTwoChecksAppearsOnce) {
  // model_parallel_size without deepspeed+mpu: the trainer section and the batch resolution both
  // find it.
  const std::string e = input_error([] {
    config_from_json(json({{"train_batch_size", 4}, {"trainer", {{"model_parallel_size", 2}}}}), "c.json", 2);
  });
  EXPECT_EQ(lines_of(e), std::vector<std::string>{"c.json: trainer.model_parallel_size is 2: tensor parallelism needs "
                                                  "env_type 'deepspeed+mpu', not 'pytorch'"});
}

TEST(ConfigAllErrors, AMisspeltBatchKeyIsNotAlsoReportedAsMissing) {
  const std::string e = input_error([] { config_from_json(json({{"train_batch_sise", 4}}), "c.json", 1); });
  EXPECT_EQ(lines_of(e), std::vector<std::string>{"c.json: unknown key 'train_batch_sise' (did you mean 'train_batch_size'?)"});
}

TEST(ConfigAllErrors, AProgramExitsTwoNamingEveryError) {
  TempDir tmp("pt_newcomer");
  const std::string config = tmp.write("two.json", json({{"train_batch_size", 8}, {"optimizer", {{"params", {{"lr", -1}}}}},
                                                         {"trainer", {{"epochs", -2}}}}).dump());
  const auto r = polytrain::testing::run_program(POLYTRAIN_BINARY_DIR "/train_bert --config " + config);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'optimizer.params.lr' must be >= 0, got -1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("'trainer.epochs' must be >= 0, got -2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// ---- 4. near-miss model keys ----------------------------------------------------------------

TEST(ConfigModelKeys, AKeyOneTypoFromAKnownOneIsWarnedAbout) {
  using config_detail::model_key_warnings;
  EXPECT_EQ(model_key_warnings({{"model_type", "gpt2"}, {"n_layers", 2}, {"n_embd", 64}}),
            std::vector<std::string>{"model.n_layers: unknown key; did you mean n_layer?"});
  EXPECT_EQ(model_key_warnings({{"model_type", "bert"}, {"num_hidden_layer", 2}}),
            std::vector<std::string>{"model.num_hidden_layer: unknown key; did you mean num_hidden_layers?"});
  EXPECT_EQ(model_key_warnings({{"model_type", "t5"}, {"d_modle", 64}}),
            std::vector<std::string>{"model.d_modle: unknown key; did you mean d_model?"});
  EXPECT_EQ(model_key_warnings({{"model_type", "albert"}, {"embeding_size", 64}}),
            std::vector<std::string>{"model.embeding_size: unknown key; did you mean embedding_size?"});
  // Hugging Face's own keys, and ones far from any known key, stay silent
  EXPECT_TRUE(model_key_warnings({{"model_type", "roberta"}, {"bos_token_id", 0}, {"eos_token_id", 2},
                                  {"architectures", {"RobertaForMaskedLM"}}, {"torch_dtype", "float32"},
                                  {"task_specific_params", json::object()}})
                  .empty());
  EXPECT_TRUE(model_key_warnings({{"model_type", "gpt2"}, {"n_ctx", 1024}, {"summary_type", "cls_index"}}).empty());
}

TEST(ConfigModelKeys, TheProgramsWarningIsOneStderrLine) {
  const Config cfg = config_from_json(json({{"train_batch_size", 4}, {"model", {{"model_type", "gpt2"}, {"n_layers", 2}}}}),
                                      "c.json", 1);
  ::testing::internal::CaptureStderr();
  warn_ignored_keys(cfg);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "warning: model.n_layers: unknown key; did you mean n_layer?\n");
}

// ---- 5. FlagAI's names ----------------------------------------------------------------------

TEST(ConfigFlagAi, EachTrainerNameMeansItsDeepSpeedKey) {
  const Config cfg = config_from_json(json({{"trainer", {{"batch_size", 8}, {"gradient_accumulation_steps", 2},
                                                         {"lr", 3e-4}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                                         {"fp16", true}, {"master_ip", "10.0.0.1"}}}}),
                                      "flagai.json", 2);
  EXPECT_EQ(cfg.batch.train_micro_batch_size_per_gpu, 8);  // per process, as FlagAI's
  EXPECT_EQ(cfg.batch.gradient_accumulation_steps, 2);
  EXPECT_EQ(cfg.batch.train_batch_size, 32);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(cfg.optimizer.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 1.0);
  EXPECT_TRUE(cfg.fp16.enabled);
  EXPECT_EQ(cfg.trainer.master_ip, "10.0.0.1");
  // the resolved config is DeepSpeed's and reads back the same
  const json dumped = config_to_json(cfg);
  EXPECT_FALSE(dumped["trainer"].contains("batch_size"));
  EXPECT_EQ(config_to_json(config_from_json(dumped, "again.json", 2)), dumped);
}

TEST(ConfigFlagAi, TheSameValueUnderBothNamesIsNoConflict) {
  const Config cfg = config_from_json(
      json({{"train_micro_batch_size_per_gpu", 8}, {"optimizer", {{"params", {{"lr", 0.001}}}}},
            {"trainer", {{"batch_size", 8}, {"lr", 1e-3}}}}), "c.json", 1);
  EXPECT_EQ(cfg.batch.train_micro_batch_size_per_gpu, 8);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 1e-3);
}

TEST(ConfigFlagAi, ConflictsNameBothKeysAllInOnePass) {
  const json doc = {{"train_micro_batch_size_per_gpu", 16},
                    {"gradient_clipping", 0.5},
                    {"fp16", {{"enabled", false}}},
                    {"trainer", {{"batch_size", 8}, {"clip_grad", 1.0}, {"fp16", true}}}};
  const auto lines = lines_of(input_error([&] { config_from_json(doc, "c.json", 1); }));
  EXPECT_EQ(lines, (std::vector<std::string>{
                       "c.json: 'trainer.batch_size' (8) and 'train_micro_batch_size_per_gpu' (16) are both given "
                       "with different values; give one (FlagAI's batch_size is per process)",
                       "c.json: 'trainer.clip_grad' (1.0) and 'gradient_clipping' (0.5) are both given with different "
                       "values; give one (FlagAI's clip_grad is the global gradient-norm clip)",
                       "c.json: 'trainer.fp16' (true) and 'fp16.enabled' (false) are both given with different values; "
                       "give one (FlagAI's fp16 switches DeepSpeed's fp16 block on)"}));
}

TEST(ConfigFlagAi, AWrongTypeNamesTheFlagAiKey) {
  const std::string e = input_error([] {
    config_from_json(json({{"train_batch_size", 4}, {"trainer", {{"batch_size", "8"}, {"fp16", 1}}}}), "c.json", 1);
  });
  EXPECT_EQ(lines_of(e), (std::vector<std::string>{
                             "c.json: 'trainer.batch_size' must be an integer, got string \"8\" (it means "
                             "train_micro_batch_size_per_gpu)",
                             "c.json: 'trainer.fp16' must be a boolean (true/false), got number 1 (it means fp16.enabled)"}));
}

TEST(ConfigFlagAi, WarmUpIsAFractionOfTheRunsSteps) {
  // no scheduler: FlagAI's own schedule, linear warmup to lr then linear decay to 0
  const Config own = config_from_json(
      json({{"train_batch_size", 4}, {"trainer", {{"lr", 2e-4}, {"warm_up", 0.1}, {"max_steps", 305}}}}), "c.json", 1);
  EXPECT_EQ(own.scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(own.scheduler.warmup_num_steps, 31);  // round(0.1 x 305 = 30.5)
  EXPECT_EQ(own.scheduler.total_num_steps, 305);
  EXPECT_EQ(own.scheduler.warmup_type, "linear");
  EXPECT_DOUBLE_EQ(own.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(own.scheduler.warmup_max_lr, 2e-4);
  // a given warmup scheduler: its total_num_steps is the run's length
  const Config given = config_from_json(
      json({{"train_batch_size", 4},
            {"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 200}}}}},
            {"trainer", {{"warm_up", 0.05}, {"max_steps", 1000}}}}),
      "c.json", 1);
  EXPECT_EQ(given.scheduler.type, "WarmupCosineLR");
  EXPECT_EQ(given.scheduler.warmup_num_steps, 10);
  // WarmupLR has no total: trainer.max_steps
  const Config plain = config_from_json(
      json({{"train_batch_size", 4}, {"scheduler", {{"type", "WarmupLR"}}}, {"trainer", {{"warm_up", 0.5}, {"max_steps", 40}}}}),
      "c.json", 1);
  EXPECT_EQ(plain.scheduler.warmup_num_steps, 20);
}

TEST(ConfigFlagAi, WarmUpErrors) {
  auto error = [](const json& doc) { return input_error([&] { config_from_json(doc, "c.json", 1); }); };
  EXPECT_EQ(error({{"train_batch_size", 4}, {"trainer", {{"warm_up", 0.1}, {"epochs", 3}}}}),
            "c.json: 'trainer.warm_up' (0.1 of the run) needs the run's length in steps: give trainer.max_steps "
            "(--max_steps N) or scheduler.params.total_num_steps");
  EXPECT_EQ(error({{"train_batch_size", 4}, {"trainer", {{"warm_up", 1.5}, {"max_steps", 10}}}}),
            "c.json: 'trainer.warm_up' must be a fraction of the run's steps in [0, 1] (FlagAI's warm_up), got number 1.5");
  EXPECT_EQ(error({{"train_batch_size", 4},
                   {"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 20}, {"total_num_steps", 300}}}}},
                   {"trainer", {{"warm_up", 0.1}}}}),
            "c.json: 'trainer.warm_up' (0.1 x 300 steps = 30) and 'scheduler.params.warmup_num_steps' (20) are both "
            "given with different values; give one");
  EXPECT_EQ(error({{"train_batch_size", 4},
                   {"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 0.0}, {"cycle_max_lr", 0.1}}}}},
                   {"trainer", {{"warm_up", 0.1}, {"max_steps", 10}}}}),
            "c.json: 'trainer.warm_up' has no meaning for scheduler.type 'OneCycle' (it has no warmup phase); remove "
            "one of them, or use WarmupDecayLR");
}

TEST(ConfigFlagAi, AFlagReplacesTheFilesFlagAiName) {
  // The file says trainer.batch_size 8; --batch_size 16 writes train_micro_batch_size_per_gpu.
  json file = {{"trainer", {{"batch_size", 8}, {"lr", 0.1}}}};
  EXPECT_TRUE(prepare_config_sources(file, "", json::object()).empty());
  EXPECT_EQ(file, json({{"train_micro_batch_size_per_gpu", 8}, {"optimizer", {{"params", {{"lr", 0.1}}}}},
                        {"trainer", json::object()}}));
  const json overrides = {{"train_micro_batch_size_per_gpu", 16}, {"optimizer", {{"params", {{"lr", 0.5}}}}}};
  const Config cfg = config_from_json_with(apply_overrides(file, overrides, 1), "f.json + command line", 1, {});
  EXPECT_EQ(cfg.batch.train_micro_batch_size_per_gpu, 16);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 0.5);
}

}  // namespace
}  // namespace polytrain
