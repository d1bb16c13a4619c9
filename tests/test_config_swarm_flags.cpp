// The hivemind collaborative-training tutorial's flags (common/config.h, cli_config.h):
// averaging_expiration is matchmaking_time under hivemind's CollaborativeOptimizer name (JSON
// alias and flag), batch_size_lead lowers the target a peer steps at. Both parse from the file
// and the command line, errors name the key as the user wrote it, and a program given a bad
// value says so in one line and exits 2.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "helpers/program.h"
#include "polytrain/common/cli_config.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace {

using nlohmann::json;

json hivemind_doc(const json& section) {
  return {{"train_batch_size", 16}, {"trainer", {{"env_type", "hivemind"}}}, {"hivemind", section}};
}

std::string error_of(const json& doc) {
  try {
    config_from_json(doc, "config.json", 1);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

struct Cli {
  CLI::App app{"test"};
  ConfigFlags flags;
  Cli() { add_config_flags(app, flags); }
  bool parse(std::vector<std::string> args) {
    args.insert(args.begin(), "prog");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return parse_cli(app, static_cast<int>(argv.size()), argv.data());
  }
};

class TempFile {
 public:
  explicit TempFile(const json& doc)
      : path_((std::filesystem::temp_directory_path() /
               ("polytrain_swarm_flags_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++) + ".json"))
                  .string()) {
    std::ofstream(path_) << doc.dump();
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

TEST(SwarmFlags, AveragingExpirationIsMatchmakingTimeInJson) {
  const Config a = config_from_json(hivemind_doc({{"target_batch_size", 64}, {"averaging_expiration", 5}}), "c", 1);
  EXPECT_DOUBLE_EQ(a.hivemind.matchmaking_time, 5.0);
  const Config b = config_from_json(hivemind_doc({{"target_batch_size", 64}, {"matchmaking_time", 7}}), "c", 1);
  EXPECT_DOUBLE_EQ(b.hivemind.matchmaking_time, 7.0);
  const Config d = config_from_json(hivemind_doc({{"target_batch_size", 64}}), "c", 1);
  EXPECT_DOUBLE_EQ(d.hivemind.matchmaking_time, 15.0);  // polytrain's (and hivemind.Optimizer's) default
  EXPECT_EQ(d.hivemind.batch_size_lead, 0);
  // Written back under the one name (the resolved config, --print_config).
  const json out = config_to_json(a);
  EXPECT_EQ(out["hivemind"]["matchmaking_time"], 5.0);
  EXPECT_FALSE(out["hivemind"].contains("averaging_expiration"));
  EXPECT_EQ(out["hivemind"]["batch_size_lead"], 0);
}

TEST(SwarmFlags, BatchSizeLeadParses) {
  const Config c = config_from_json(hivemind_doc({{"target_batch_size", 64}, {"batch_size_lead", 16}}), "c", 1);
  EXPECT_EQ(c.hivemind.batch_size_lead, 16);
  EXPECT_EQ(c.hivemind.target_batch_size, 64);  // the global batch the run declares stays the target
  EXPECT_EQ(config_to_json(c)["hivemind"]["batch_size_lead"], 16);
  EXPECT_EQ(config_from_json(config_to_json(c), "round trip", 1).hivemind.batch_size_lead, 16);
}

TEST(SwarmFlags, BadValuesNameTheKeyAsGiven) {
  struct Case {
    json section;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{{"target_batch_size", 64}, {"averaging_expiration", 0}}, "'hivemind.averaging_expiration' must be > 0 seconds"},
      {{{"target_batch_size", 64}, {"matchmaking_time", 0}}, "'hivemind.matchmaking_time' must be > 0 seconds"},
      {{{"target_batch_size", 64}, {"averaging_expiration", 70}},
       "'hivemind.averaging_expiration' (70 s) must be shorter than hivemind.averaging_timeout (60 s)"},
      {{{"target_batch_size", 64}, {"averaging_expiration", 4}, {"request_timeout", 5}},
       "'hivemind.request_timeout' (5 s) must be shorter than hivemind.averaging_expiration (4 s)"},
      {{{"target_batch_size", 64}, {"averaging_expiration", 5}, {"matchmaking_time", 5}},
       "'hivemind.averaging_expiration' repeats 'hivemind.matchmaking_time' (same setting, another name); give one"},
      {{{"target_batch_size", 64}, {"averaging_expiration", "5s"}}, "'hivemind.averaging_expiration' must be a number"},
      {{{"target_batch_size", 64}, {"batch_size_lead", -1}}, "'hivemind.batch_size_lead' must be >= 0, got -1"},
      {{{"target_batch_size", 64}, {"batch_size_lead", 64}},
       "'hivemind.batch_size_lead' (64) must be below hivemind.target_batch_size (64)"},
      {{{"target_batch_size", 64}, {"batch_size_lead", 1.5}}, "'hivemind.batch_size_lead' must be an integer"},
      {{{"target_batch_size", 64}, {"batch_size_leed", 8}}, "did you mean 'batch_size_lead'?"},
      // No target yet: the missing target is the error, not the lead.
      {{{"batch_size_lead", 8}}, "hivemind.target_batch_size: env_type 'hivemind' needs"},
  };
  for (const auto& c : cases) {
    const std::string err = error_of(hivemind_doc(c.section));
    EXPECT_NE(err.find(c.error), std::string::npos) << c.section.dump() << "\n  got: '" << err << "'";
  }
}

TEST(SwarmFlags, FlagsWriteTheirKeyAndReplaceTheFilesOtherName) {
  {
    Cli cli;
    ASSERT_TRUE(cli.parse({"--averaging_expiration", "5", "--batch_size_lead", "16"}));
    EXPECT_EQ(cli.flags.overrides["hivemind"]["averaging_expiration"], 5.0);
    EXPECT_EQ(cli.flags.overrides["hivemind"]["batch_size_lead"], 16);
  }
  struct Case {
    json file_section;
    std::vector<std::string> args;
    double matchmaking;
    int64_t lead;
  };
  const std::vector<Case> cases = {
      {{{"target_batch_size", 64}}, {"--averaging_expiration", "5"}, 5.0, 0},
      {{{"target_batch_size", 64}, {"matchmaking_time", 7}}, {"--averaging_expiration", "5"}, 5.0, 0},
      {{{"target_batch_size", 64}, {"averaging_expiration", 7}}, {"--matchmaking_time", "4"}, 4.0, 0},
      {{{"target_batch_size", 64}, {"averaging_expiration", 7}}, {}, 7.0, 0},
      {{{"target_batch_size", 64}, {"batch_size_lead", 8}}, {"--batch_size_lead", "32"}, 15.0, 32},
  };
  for (const auto& c : cases) {
    TempFile file(hivemind_doc(c.file_section));
    Cli cli;
    std::vector<std::string> args = {"--config", file.path()};
    args.insert(args.end(), c.args.begin(), c.args.end());
    ASSERT_TRUE(cli.parse(args));
    const Config cfg = build_config(cli.flags, 1);
    EXPECT_DOUBLE_EQ(cfg.hivemind.matchmaking_time, c.matchmaking) << c.file_section.dump();
    EXPECT_EQ(cfg.hivemind.batch_size_lead, c.lead) << c.file_section.dump();
  }
  {
    Cli cli;  // the same setting twice on one command line
    try {
      cli.parse({"--averaging_expiration", "5", "--matchmaking_time", "4"});
      FAIL() << "no error";
    } catch (const InputError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("--averaging_expiration"), std::string::npos) << what;
      EXPECT_NE(what.find("--matchmaking_time"), std::string::npos) << what;
    }
  }
  {
    Cli cli;  // a flag's value goes through the file's validation, named as given
    ASSERT_TRUE(cli.parse({"--train_batch_size", "16", "--env_type", "hivemind", "--target_batch_size", "64",
                           "--averaging_expiration", "-1"}));
    try {
      build_config(cli.flags, 1);
      FAIL() << "no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'hivemind.averaging_expiration' must be > 0 seconds"), std::string::npos)
          << e.what();
    }
  }
}

// As a user runs a peer: --print_config shows the resolved keys; bad values are one `error:`
// line and exit code 2 (nothing starts).
TEST(SwarmFlags, ProgramsTakeTheFlagsAndRefuseBadValuesWithExitTwo) {
  using testing::expect_one_line_error;
  using testing::run_program;
  const std::string hm = POLYTRAIN_BINARY_DIR "/train_bert --config configs/bert_tiny.json --env_type hivemind "
                         "--train_batch_size 16 --train_micro_batch_size_per_gpu 16 --gradient_accumulation_steps 1 "
                         "--target_batch_size 64";
  const auto shown = run_program(hm + " --averaging_expiration 5 --batch_size_lead 16 --print_config 2>/dev/null");
  ASSERT_EQ(shown.code, 0) << shown.out;
  const json resolved = json::parse(shown.out);
  EXPECT_EQ(resolved["hivemind"]["matchmaking_time"], 5.0);
  EXPECT_EQ(resolved["hivemind"]["batch_size_lead"], 16);
  EXPECT_EQ(resolved["hivemind"]["target_batch_size"], 64);

  expect_one_line_error(run_program(hm + " --averaging_expiration 0"), "'hivemind.averaging_expiration' must be > 0");
  expect_one_line_error(run_program(hm + " --averaging_expiration 90"),
                        "'hivemind.averaging_expiration' (90 s) must be shorter than hivemind.averaging_timeout");
  expect_one_line_error(run_program(hm + " --averaging_expiration soon"), "--averaging_expiration");
  expect_one_line_error(run_program(hm + " --averaging_expiration 5 --matchmaking_time 5"), "--averaging_expiration");
  expect_one_line_error(run_program(hm + " --batch_size_lead 64"),
                        "'hivemind.batch_size_lead' (64) must be below hivemind.target_batch_size (64)");
  expect_one_line_error(run_program(hm + " --batch_size_lead -8"), "'hivemind.batch_size_lead' must be >= 0, got -8");
  expect_one_line_error(run_program(hm + " --batch_size_lead some"), "--batch_size_lead");
}

}  // namespace
}  // namespace polytrain
