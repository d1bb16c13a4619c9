// What a newcomer types first (issue 44): grouped --help with defaults, FlagAI's and torchrun's
// flag names, an unknown flag answered with the nearest known one, a rank error shown once by
// the launcher, and a busy --master_port named before the ranks start. Messages and exit codes.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "helpers/free_port.h"
#include "helpers/program.h"
#include "helpers/temp_dir.h"
#include "polytrain/common/cli_config.h"
#include "polytrain/common/cli_suggest.h"
#include "polytrain/common/error.h"
#include "polytrain/launcher/port_check.h"
#include "polytrain/launcher/repeated_errors.h"
#include "polytrain/launcher/torchrun_names.h"

using json = nlohmann::json;
using polytrain::ConfigFlags;
using polytrain::InputError;
using polytrain::testing::expect_one_line_error;
using polytrain::testing::run_program;
using polytrain::testing::TempDir;
namespace launcher = polytrain::launcher;

namespace {

const std::string kLaunch = POLYTRAIN_BINARY_DIR "/launch";

// The overrides add_config_flags collects from `args`, or the InputError's text.
struct Parsed {
  json overrides;
  std::string error;
};

Parsed parse(std::vector<std::string> args) {
  CLI::App app{"test"};
  ConfigFlags flags;
  polytrain::add_config_flags(app, flags);
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  try {
    polytrain::parse_cli(app, static_cast<int>(argv.size()), argv.data());
  } catch (const InputError& e) {
    return {json(), e.what()};
  }
  return {flags.overrides, ""};
}

std::string help_text() {
  CLI::App app{"test"};
  ConfigFlags flags;
  polytrain::add_config_flags(app, flags);
  return app.help();
}

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(NewcomerHelp, GroupsEachOnceWithDefaults) {
  const std::string help = help_text();
  for (const char* heading : {"\nTrainer:\n", "\nBatch (", "\nOptimizer:\n", "\nPrecision:\n", "\nParallel:\n",
                              "\nData:\n", "\nHivemind (", "\nLauncher side ("})
    EXPECT_EQ(count_of(help, heading), 1) << heading << " in:\n" << help;
  // Defaults are the config structs' (config.h).
  for (const char* shown : {"--max_steps INT=0", "--log_interval INT=10", "--eval_interval INT=100", "--seed UINT=1234",
                            "--experiments_dir TEXT=experiments", "--env_type TEXT=pytorch", "--lr FLOAT=0.001",
                            "--run_id TEXT=polytrain", "--listen TEXT=0.0.0.0:0", "--matchmaking_time FLOAT=15",
                            "--min_group_size INT=2", "--target_group_size INT=256", "--master_port INT=29500"})
    EXPECT_NE(help.find(shown), std::string::npos) << shown << " in:\n" << help;
  // A flag sits in its group: --fp16 after the Precision heading, before the next one.
  const size_t precision = help.find("\nPrecision:\n"), parallel = help.find("\nParallel:\n");
  const size_t fp16 = help.find("--fp16");
  EXPECT_TRUE(precision < fp16 && fp16 < parallel) << help;
}

TEST(NewcomerHelp, HivemindFlagsSayWhatTheyDo) {
  CLI::App app{"test"};
  ConfigFlags flags;
  polytrain::add_config_flags(app, flags);
  int hivemind = 0;
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_group().rfind("Hivemind", 0) != 0) continue;
    ++hivemind;
    const std::string& d = opt->get_description();
    EXPECT_EQ(d.rfind("hivemind.", 0), std::string::npos) << opt->get_name() << ": " << d;
    EXPECT_GE(std::count(d.begin(), d.end(), ' '), 4) << opt->get_name() << ": '" << d << "' is not a sentence";
  }
  EXPECT_GE(hivemind, 25);
}

TEST(NewcomerHelp, VocabFileNamesEachTokenizersFile) {
  CLI::App app{"test"};
  ConfigFlags flags;
  polytrain::add_config_flags(app, flags);
  const std::string d = app.get_option("--vocab_file")->get_description();
  for (const char* name : {"vocab.txt", "encoder.json", "vocab.bpe", "SentencePiece"})
    EXPECT_NE(d.find(name), std::string::npos) << name << " in: " << d;
}

TEST(NewcomerHelp, ProgramHelpIsGroupedAndExitsZero) {
  const auto r = run_program(POLYTRAIN_BINARY_DIR "/train_gpt2 --help");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count_of(r.out, "\nHivemind ("), 1) << r.out;
  EXPECT_EQ(count_of(r.out, "\nTrainer:\n"), 1) << r.out;
  EXPECT_NE(r.out.find("--merges"), std::string::npos) << r.out;  // the program's own flags stay
}

TEST(FlagAiNames, MapToTheirDeepSpeedKeys) {
  const Parsed p = parse({"--batch_size", "8", "--fp16", "--weight_decay", "0.1", "--clip_grad", "1.5", "--warm_up",
                          "0.1", "--lr", "0.01", "--gradient_accumulation_steps", "2", "--master_ip", "10.0.0.1"});
  ASSERT_EQ(p.error, "");
  EXPECT_EQ(p.overrides["train_micro_batch_size_per_gpu"], 8);
  EXPECT_EQ(p.overrides["gradient_accumulation_steps"], 2);
  EXPECT_EQ(p.overrides["fp16"]["enabled"], true);
  EXPECT_EQ(p.overrides["optimizer"]["params"]["weight_decay"], 0.1);
  EXPECT_EQ(p.overrides["optimizer"]["params"]["lr"], 0.01);
  EXPECT_EQ(p.overrides["gradient_clipping"], 1.5);
  EXPECT_EQ(p.overrides["trainer"]["warm_up"], 0.1);
  EXPECT_EQ(p.overrides["trainer"]["master_ip"], "10.0.0.1");
  EXPECT_EQ(parse({"--gradient_clipping", "2"}).overrides["gradient_clipping"], 2.0);
}

TEST(FlagAiNames, DefaultsShownAreNotApplied) {
  const Parsed p = parse({});
  ASSERT_EQ(p.error, "");
  EXPECT_TRUE(p.overrides.empty()) << p.overrides.dump();
}

TEST(FlagAiNames, BatchSizeIsABatchKeyAndConflictsWithItsDeepSpeedName) {
  // file {32, 8, 4} + --batch_size 16 at world size 1 -> {32, 16, 2}, the batch-key rule.
  const json file = {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 8}, {"gradient_accumulation_steps", 4}};
  const json merged = polytrain::apply_overrides(file, parse({"--batch_size", "16"}).overrides, 1);
  const polytrain::BatchConfig batch = polytrain::config_from_json(merged, "test", 1).batch;
  EXPECT_EQ(batch.train_batch_size, 32);
  EXPECT_EQ(batch.train_micro_batch_size_per_gpu, 16);
  EXPECT_EQ(batch.gradient_accumulation_steps, 2);
  const Parsed both = parse({"--batch_size", "8", "--train_micro_batch_size_per_gpu", "8"});
  EXPECT_EQ(both.error, "--batch_size and --train_micro_batch_size_per_gpu are one setting (FlagAI's and DeepSpeed's "
                        "name for it): give one");
}

TEST(FlagAiNames, TrainBertTakesThemFromTheCommandLine) {
  const auto r = run_program(POLYTRAIN_BINARY_DIR "/train_bert --config configs/bert_tiny.json --num_gpus 2 "
                             "--batch_size 8 --weight_decay 0.05 --clip_grad 0.5 --warm_up 0.1 --fp16 --print_config");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("not expected"), std::string::npos) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["train_micro_batch_size_per_gpu"], 8);
  EXPECT_EQ(j["train_batch_size"], 16);
  EXPECT_EQ(j["gradient_clipping"], 0.5);
  EXPECT_EQ(j["optimizer"]["params"]["weight_decay"], 0.05);
  EXPECT_EQ(j["fp16"]["enabled"], true);
  // trainer.warm_up is a share of the schedule's steps (config_flagai.cpp): 0.1 of bert_tiny's 300.
  EXPECT_EQ(j["scheduler"]["params"]["warmup_num_steps"], 30) << j["scheduler"].dump();
}

TEST(UnknownFlag, SuggestsTheNearestKnownOne) {
  EXPECT_EQ(parse({"--max_step", "5"}).error, "unknown flag --max_step; did you mean --max_steps?");
  EXPECT_EQ(parse({"--max_step=5"}).error, "unknown flag --max_step; did you mean --max_steps?");
  EXPECT_EQ(parse({"--num_gpu", "2"}).error, "unknown flag --num_gpu; did you mean --num_gpus?");
  EXPECT_EQ(parse({"--wamr_up", "0.1"}).error, "unknown flag --wamr_up; did you mean --warm_up?");
  EXPECT_EQ(parse({"--zzzzzzzz"}).error, "unknown flag --zzzzzzzz (see --help)");
  EXPECT_NE(parse({"stray"}).error.find("unexpected argument 'stray'"), std::string::npos);
}

TEST(UnknownFlag, ProgramSaysItInOneLineExitTwo) {
  expect_one_line_error(run_program(POLYTRAIN_BINARY_DIR "/train_bert --config configs/bert_tiny.json --max_step 5"),
                        "unknown flag --max_step; did you mean --max_steps?");
  expect_one_line_error(run_program(kLaunch + " --num_gpu 2 prog"), "unknown flag --num_gpu; did you mean --num_gpus?");
  expect_one_line_error(run_program(kLaunch + " --bogus_flag 1 prog"), "unknown flag --bogus_flag (see --help)");
}

TEST(LaunchHelp, UsageShowsTheProgramAndTorchrunNames) {
  const auto r = run_program(kLaunch + " --help");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[OPTIONS] PROGRAM [ARGS...]\n"), std::string::npos) << r.out;
  for (const char* name : {"--nproc_per_node", "--nnodes", "--rdzv_endpoint", "--node_rank"})
    EXPECT_NE(r.out.find(name), std::string::npos) << name;
}

// ---- torchrun's names: the mapping itself, then launch --dry_run and launch's refusals ----------

namespace {

launcher::LaunchOptions torchrun(const launcher::TorchrunNames& t, launcher::LaunchOptions o = {}) {
  launcher::apply_torchrun_names(t, o);
  return o;
}

std::string torchrun_error(const launcher::TorchrunNames& t, launcher::LaunchOptions o = {}) {
  try {
    launcher::apply_torchrun_names(t, o);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TorchrunNames, MapOntoLaunchOptions) {
  EXPECT_EQ(torchrun({"4", "", "", false, 1}).num_gpus, 4);
  auto o = torchrun({"", "", "10.0.0.1:29600", false, 1});
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 29600);
  EXPECT_EQ(torchrun({"", "", "node0", false, 1}).master_port, 29500);  // port optional, as torchrun's
  o = torchrun({"", "2", "", true, 1});  // with a hostfile: the first 2 hosts
  EXPECT_EQ(o.num_nodes, 2);
  EXPECT_FALSE(o.no_ssh);
  launcher::LaunchOptions with_rank;
  with_rank.node_rank = 1;
  o = torchrun({"", "2", "", true, 1}, with_rank);  // with a hostfile and --node_rank: that host only
  EXPECT_TRUE(o.no_ssh);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_TRUE(o.node_slots.empty());
}

TEST(TorchrunNames, StaticRendezvousWithoutAHostfile) {
  launcher::LaunchOptions o;
  o.node_rank = 1;
  o.master_addr = "10.0.0.1";
  o = torchrun({"2", "3", "", false, 1}, o);
  EXPECT_EQ(o.node_slots, "0-1");
  EXPECT_EQ(o.rank_offset, 2);
  EXPECT_EQ(o.world_size, 6);
  EXPECT_EQ(o.world_nodes, 3);
  EXPECT_EQ(o.node_rank, 1);
  // What ssh and pdsh pass to a per-node launcher is left alone.
  launcher::LaunchOptions per_node;
  per_node.node_rank = 1;
  per_node.node_slots = "0-3";
  EXPECT_EQ(torchrun({"", "", "", false, 1}, per_node).node_slots, "0-3");
  EXPECT_FALSE(torchrun({"", "", "", false, 1}, per_node).no_ssh);
}

TEST(TorchrunNames, RefusalsNameThePolytrainEquivalent) {
  EXPECT_NE(torchrun_error({"", "1:4", "", false, 1}).find("--nnodes 1:4: elastic node ranges are not supported"),
            std::string::npos);
  EXPECT_NE(torchrun_error({"", "1:4", "", false, 1}).find("--num_nodes"), std::string::npos);
  EXPECT_NE(torchrun_error({"auto", "", "", false, 1}).find("--nproc_per_node auto: give a number"), std::string::npos);
  EXPECT_NE(torchrun_error({"", "", "h:notaport", false, 1}).find("'notaport' is not a TCP port"), std::string::npos);
  EXPECT_NE(torchrun_error({"", "2", "", false, 1}).find("needs --master_addr"), std::string::npos);
  launcher::LaunchOptions rank2;
  rank2.node_rank = 2;
  rank2.master_addr = "10.0.0.1";
  EXPECT_NE(torchrun_error({"", "2", "", false, 1}, rank2).find("--node_rank 2 is not below --nnodes 2"),
            std::string::npos);
  EXPECT_NE(torchrun_error({"", "", "", false, 1}, rank2).find("needs --nnodes"), std::string::npos);
}

TEST(TorchrunNames, LaunchDryRunPlans) {
  TempDir t;
  auto plan = [&](const std::string& flags) {
    const auto r = run_program("cd " + t.str() + " && " + kLaunch + " " + flags + " --dry_run prog 2>/dev/null");
    EXPECT_EQ(r.code, 0) << flags << ": " << r.out;
    return r.code == 0 ? json::parse(r.out) : json::object();
  };
  json j = plan("--nproc_per_node 3");
  EXPECT_EQ(j["world_size"], 3);
  j = plan("--nproc_per_node 2 --rdzv_endpoint 127.0.0.1:29777");
  EXPECT_EQ(j["master_port"], 29777);
  j = plan("--nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 10.1.2.3 --master_port 29999");
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["master_addr"], "10.1.2.3");
  EXPECT_EQ(j["hosts"][0]["ranks"], json({2, 3})) << j.dump();
  t.write("hostfile", "localhost slots=2\nnodeB slots=2\n");
  j = plan("--hostfile hostfile --nnodes 1");
  EXPECT_EQ(j["hosts"].size(), 1u) << j.dump();
  EXPECT_EQ(j["world_size"], 2);
}

TEST(TorchrunNames, LaunchRefusesInOneLineExitTwo) {
  expect_one_line_error(run_program(kLaunch + " --nnodes 1:4 prog"), "elastic node ranges are not supported");
  expect_one_line_error(run_program(kLaunch + " --nproc_per_node gpu prog"), "--nproc_per_node gpu: give a number");
  expect_one_line_error(run_program(kLaunch + " --nproc_per_node 2 --num_gpus 2 prog"), "--nproc_per_node and --num_gpus both given: --nproc_per_node is torchrun's name for --num_gpus; give one");
  expect_one_line_error(run_program(kLaunch + " --rdzv_endpoint h:1 --master_port 2 prog"), "--rdzv_endpoint and --master_port both given");
  expect_one_line_error(run_program(kLaunch + " --nnodes 2 --node_rank 1 prog"), "needs --master_addr");
}

// ---- the launcher shows a repeated rank error once ---------------------------------------------

TEST(RepeatedErrors, RankRanges) {
  EXPECT_EQ(launcher::rank_ranges({3}), "rank 3");
  EXPECT_EQ(launcher::rank_ranges({2, 0, 1}), "ranks 0-2");
  EXPECT_EQ(launcher::rank_ranges({8, 0, 1, 2, 5, 7, 5}), "ranks 0-2, 5, 7-8");
}

TEST(RepeatedErrors, EachErrorLineOnce) {
  launcher::RepeatedErrors e;
  EXPECT_TRUE(e.show("step 1", 0));
  EXPECT_TRUE(e.show("step 1", 1));  // only error lines are folded
  EXPECT_TRUE(e.show("error: bad batch", 2));
  EXPECT_FALSE(e.show("error: bad batch", 0));
  EXPECT_FALSE(e.show("error: bad batch", 1));
  EXPECT_TRUE(e.show("error: other", 1));
  EXPECT_TRUE(e.shown("error: bad batch"));
  EXPECT_FALSE(e.shown("step 1"));
  EXPECT_EQ(e.notes(), std::vector<std::string>({"(same error as rank 2 on ranks 0-1)"}));
}

TEST(RepeatedErrors, LaunchShowsASharedErrorOnceAndKeepsTheLogs) {
  TempDir t;
  const std::string script = t.write("fail.sh", "#!/bin/sh\necho \"step on $RANK\"\necho 'error: train_batch_size (16) "
                                                "does not divide' >&2\nsleep 1\nexit 2\n");
  ::chmod(script.c_str(), 0755);
  const auto r = run_program(kLaunch + " --num_gpus 3 --no_mpi_world --slot_type cpu --master_port " +
                             std::to_string(polytrain::testing::free_port()) + " --log_dir " + t.str("logs") + " " +
                             script);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(count_of(r.out, "error: train_batch_size (16) does not divide"), 1) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\(same error as rank [0-2] on ranks [0-2](-|, )[0-2]\\)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\nerror: rank [0-2] \\(host localhost\\) \\(pid [0-9]+\\) exited with "
                                                  "code 2 with the error above; stopped the other 2 process\\(es\\)")))
      << r.out;
  for (int rank = 0; rank < 3; ++rank) {
    std::ifstream log(t.str("logs/rank_" + std::to_string(rank) + ".log"));
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_NE(text.str().find("error: train_batch_size (16) does not divide"), std::string::npos) << rank;
  }
}

// ---- a busy rendezvous port ------------------------------------------------------------------

TEST(MasterPort, BusyPortIsNamedBeforeTheRanksStart) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = polytrain::testing::loopback(0);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  EXPECT_FALSE(launcher::tcp_port_free(port));
  const auto r = run_program(kLaunch + " --num_gpus 2 --no_mpi_world --slot_type cpu --master_port " +
                             std::to_string(port) + " /bin/true");
  ::close(fd);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("launch: warning: --master_port " + std::to_string(port) + ": address in use"), std::string::npos)
      << r.out;
  EXPECT_TRUE(launcher::tcp_port_free(port));
  EXPECT_EQ(launcher::master_port_warning(port), "");
}
