// self_launch_command: when a program started without a launcher re-executes itself under
// `launch` (FlagAI's self-launching Trainer), and the command line it becomes. The processes
// themselves (losses, exit codes, SIGTERM) are tested in test_launch.cpp.
#include <gtest/gtest.h>

#include "polytrain/common/error.h"
#include "polytrain/common/self_launch.h"

namespace polytrain {
namespace {

ProcessView view(bool under_launcher = false) {
  ProcessView p;
  p.argv = {"./train_bert", "--config", "c.json", "--num_gpus", "2"};
  p.exe = "/opt/pt/bin/train_bert";
  p.under_launcher = under_launcher;
  p.find_launch = [] { return std::string("/opt/pt/bin/launch"); };
  return p;
}

TrainerOptions options(const std::string& env_type, int64_t gpus) {
  TrainerOptions t;
  t.env_type = env_type;
  t.num_gpus = gpus;
  return t;
}

TEST(SelfLaunch, OnlyDataParallelRunsAskingForSeveralProcessesWithoutALauncher) {
  for (const char* env : {"pytorchDDP", "deepspeed", "deepspeed+mpu"}) {
    EXPECT_TRUE(self_launch_command(options(env, 2), view())) << env;
    EXPECT_FALSE(self_launch_command(options(env, 1), view())) << env;  // one process: runs as it is
    EXPECT_FALSE(self_launch_command(options(env, 0), view())) << env;
    EXPECT_FALSE(self_launch_command(options(env, 2), view(true))) << env;  // already a launched rank
    auto nodes = options(env, 0);
    nodes.num_nodes = 2;
    EXPECT_TRUE(self_launch_command(nodes, view())) << env;
    auto hosts = options(env, 1);
    hosts.hostfile = "hosts";
    EXPECT_TRUE(self_launch_command(hosts, view())) << env;
  }
  for (const char* env : {"pytorch", "hivemind"}) {  // never
    auto t = options(env, 8);
    t.hostfile = "hosts";
    t.num_nodes = 2;
    EXPECT_FALSE(self_launch_command(t, view())) << env;
  }
}

TEST(SelfLaunch, TheCommandIsLaunchWithFlagAIsOptionsThenThisProgramAndItsArguments) {
  auto t = options("pytorchDDP", 2);
  auto cmd = self_launch_command(t, view());
  ASSERT_TRUE(cmd);
  EXPECT_EQ(*cmd, (std::vector<std::string>{"/opt/pt/bin/launch", "--num_gpus", "2", "--", "/opt/pt/bin/train_bert",
                                            "--config", "c.json", "--num_gpus", "2"}));
  t.hostfile = "/job/hosts";
  t.num_nodes = 3;
  t.master_ip = "10.0.0.1";
  t.master_port = 6001;
  t.training_script = "/home/u/my_trainer";
  cmd = self_launch_command(t, view());
  ASSERT_TRUE(cmd);
  EXPECT_EQ(*cmd, (std::vector<std::string>{"/opt/pt/bin/launch", "--hostfile", "/job/hosts", "--num_nodes", "3",
                                            "--num_gpus", "2", "--master_addr", "10.0.0.1", "--master_port", "6001",
                                            "--", "/home/u/my_trainer", "--config", "c.json", "--num_gpus", "2"}));
}

TEST(SelfLaunch, NoLaunchProgramIsAOneLineInputError) {
  auto p = view();
  p.find_launch = [] { return std::string(); };
  try {
    self_launch_command(options("deepspeed", 4), p);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("num_gpus 4"), std::string::npos) << m;
    EXPECT_NE(m.find("POLYTRAIN_LAUNCH"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST(SelfLaunch, FlagAIsKeysAreTrainerKeys) {
  const auto cfg = config_from_json(nlohmann::json{{"train_batch_size", 4},
                                                   {"trainer",
                                                    {{"env_type", "pytorchDDP"},
                                                     {"num_gpus", 2},
                                                     {"num_nodes", 1},
                                                     {"hostfile", "h"},
                                                     {"master_ip", "127.0.0.1"},
                                                     {"master_port", 7000},
                                                     {"training_script", "x"}}}},
                                    "c.json");
  EXPECT_EQ(cfg.trainer.num_gpus, 2);
  EXPECT_EQ(cfg.trainer.num_nodes, 1);
  EXPECT_EQ(cfg.trainer.hostfile, "h");
  EXPECT_EQ(cfg.trainer.master_ip, "127.0.0.1");
  EXPECT_EQ(cfg.trainer.master_port, 7000);
  EXPECT_EQ(cfg.trainer.training_script, "x");
  EXPECT_THROW(config_from_json(nlohmann::json{{"train_batch_size", 4}, {"trainer", {{"num_gpus", -1}}}}, "c.json"),
               InputError);
  EXPECT_THROW(config_from_json(nlohmann::json{{"train_batch_size", 4}, {"trainer", {{"master_port", 70000}}}}, "c.json"),
               InputError);
}

TEST(SelfLaunch, OptionsAreReadFromTheDocumentBeforeItIsChecked) {
  // A batch triple that only holds at world 2 does not stop the decision (the ranks check it).
  const auto t = self_launch_options(nlohmann::json{
      {"train_batch_size", 32},
      {"train_micro_batch_size_per_gpu", 16},
      {"trainer", {{"env_type", "deepspeed"}, {"num_gpus", 2}, {"master_addr", "10.1.1.1"}, {"master_port", "x"}}}});
  EXPECT_EQ(t.env_type, "deepspeed");
  EXPECT_EQ(t.num_gpus, 2);
  EXPECT_EQ(t.master_ip, "10.1.1.1");
  EXPECT_EQ(t.master_port, 0);  // wrong type: left for config_from_json to report
  EXPECT_TRUE(self_launch_command(t, view()));
  EXPECT_EQ(self_launch_options(nlohmann::json::object()).env_type, "pytorch");
}

}  // namespace
}  // namespace polytrain
