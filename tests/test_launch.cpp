// `launch` as users run it, with tests/helpers/launch_probe as the worker: the environment
// each rank gets, rank-prefixed output and log files, .deepspeed_env, a failing rank stopping
// the group with its exit code (SIGKILL after the grace period, no orphans left), SIGINT and
// SIGTERM to the launcher, --max_restarts, --dry_run JSON, bad input, and the ssh and pdsh
// runners end to end through stand-ins that run the remote command on this machine.
#include <string>

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "helpers/require.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kLaunch = POLYTRAIN_BINARY_DIR "/launch";
const std::string kProbe = POLYTRAIN_BINARY_DIR "/launch_probe";

struct Run {
  int code;
  std::string out;
  double seconds;
};

// Runs a shell command in `cwd`; stdout + stderr together unless the command redirects.
Run run(const std::string& cmd, const fs::path& cwd) {
  const std::string full = "cd '" + cwd.string() + "' && " + cmd + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out, s};
}

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() / ("pt_launch_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;  // never throw from a destructor (a daemon may still be deleting its files)
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& text, bool exec = false) const {
    std::ofstream(path / name) << text;
    if (exec) fs::permissions(path / name, fs::perms::owner_all | fs::perms::group_read | fs::perms::others_read);
    return path / name;
  }
};

// The probe lines of the output, keyed by rank.
std::map<int, json> probes(const std::string& out) {
  std::map<int, json> m;
  std::istringstream in(out);
  std::string line;
  const std::regex re(R"(^\[rank (\d+)\] probe (\{.*\})$)");
  std::smatch sm;
  while (std::getline(in, line)) {
    if (std::regex_match(line, sm, re)) m[std::stoi(sm[1])] = json::parse(sm[2].str());
  }
  return m;
}

bool alive(int pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  std::getline(stat, s);
  const auto close = s.rfind(')');
  return close == std::string::npos || s.size() < close + 3 || s[close + 2] != 'Z';  // a zombie is dead
}

// Every pid written by probes under `dir` is gone (allowing init a moment to reap).
void expect_all_dead(const fs::path& dir) {
  int checked = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const int pid = std::stoi(e.path().filename().string());
    ++checked;
    for (int i = 0; i < 50 && alive(pid); ++i) ::usleep(100000);
    EXPECT_FALSE(alive(pid)) << "process " << pid << " outlived the launcher";
  }
  EXPECT_GT(checked, 0);
}

// A fixed environment: HOME without a .deepspeed_env, a port of our own.
std::string env_prefix(const TempDir& t) { return "env HOME='" + t.path.string() + "' "; }

TEST(Launch, WorkersGetTorchrunEnvironmentAndPrefixedOutput) {
  TempDir t;
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 3 --master_port 29611 --slot_type cpu " + kProbe + " --lines 2", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 3u) << r.out;
  for (int rank = 0; rank < 3; ++rank) {
    const auto& env = p[rank]["env"];
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["CROSS_RANK"], "0");
    EXPECT_EQ(env["CROSS_SIZE"], "1");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], "29611");
    EXPECT_FALSE(env.contains("CUDA_VISIBLE_DEVICES"));
    EXPECT_EQ(p[rank]["args"].back(), "--local_rank=" + std::to_string(rank));
    EXPECT_NE(r.out.find("[rank " + std::to_string(rank) + "] line 1 of rank " + std::to_string(rank)), std::string::npos);
  }
  r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --no_local_rank --slot_type gpu " + kProbe, t.path);
  p = probes(r.out);
  ASSERT_EQ(p.size(), 2u) << r.out;
  EXPECT_EQ(p[1]["args"].size(), 0u);
  EXPECT_EQ(p[1]["env"]["CUDA_VISIBLE_DEVICES"], "0,1");
}

TEST(Launch, LogDirAndDeepSpeedEnvFile) {
  TempDir t;
  t.write(".deepspeed_env", "\n# exported to every worker\nPROBE_FROM_ENV_FILE=hello world\n\n");
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --log_dir logs " + kProbe + " --lines 3", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0]["env"]["PROBE_FROM_ENV_FILE"], "hello world");
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream f(t.path / "logs" / ("rank_" + std::to_string(rank) + ".log"));
    std::stringstream ss;
    ss << f.rdbuf();
    EXPECT_NE(ss.str().find("line 2 of rank " + std::to_string(rank)), std::string::npos) << ss.str();
    EXPECT_EQ(ss.str().find("[rank"), std::string::npos);  // files hold the raw lines
  }
  t.write(".deepspeed_env", "GOOD=1\nthis line is broken\n");
  r = run(env_prefix(t) + kLaunch + " --num_gpus 2 " + kProbe, t.path);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(".deepspeed_env:2: expected KEY=VALUE, got 'this line is broken'"), std::string::npos) << r.out;
}

TEST(Launch, FailingRankStopsTheGroupWithItsExitCode) {
  TempDir t;
  fs::create_directories(t.path / "pids");
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 3 --term_timeout 1 " + kProbe +
                   " --fail_rank 1 --exit_code 7 --fail_after 0.5 --sleep 60 --ignore_term --grandchild --pid_dir pids",
               t.path);
  EXPECT_EQ(r.code, 7) << r.out;
  EXPECT_LT(r.seconds, 15.0) << "the launcher waited on the surviving ranks";
  EXPECT_NE(r.out.find("error: rank 1 (host localhost)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exited with code 7; stopped the other 2 process(es)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  | probe rank 1 failing with 7"), std::string::npos) << r.out;
  expect_all_dead(t.path / "pids");  // workers that ignored SIGTERM and their children too
}

TEST(Launch, WorkerKilledBySignalIsReported) {
  TempDir t;
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 2 sh -c 'if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 30'", t.path);
  EXPECT_EQ(r.code, 137) << r.out;
  EXPECT_NE(r.out.find("rank 1 (host localhost)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("was killed by signal 9"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5.0);  // the survivor (sleeping 30 s) was stopped at once
}

class LauncherSignal : public ::testing::TestWithParam<std::pair<std::string, int>> {};

TEST_P(LauncherSignal, StopsWorkersAndExitsWith128PlusSignal) {
  TempDir t;
  fs::create_directories(t.path / "pids");
  const auto [sig, code] = GetParam();
  auto r = run(env_prefix(t) + "sh -c '" + kLaunch + " --num_gpus 2 " + kProbe +
                   " --sleep 60 --grandchild --pid_dir pids & pid=$!; sleep 1.5; kill -" + sig +
                   " $pid; wait $pid; echo launch_rc=$?'",
               t.path);
  EXPECT_NE(r.out.find("launch_rc=" + std::to_string(code)), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15.0);
  expect_all_dead(t.path / "pids");
}

INSTANTIATE_TEST_SUITE_P(Signals, LauncherSignal,
                         ::testing::Values(std::pair<std::string, int>{"INT", 130}, std::pair<std::string, int>{"TERM", 143}),
                         [](const auto& info) { return info.param.first; });

TEST(Launch, MaxRestartsRestartsTheWholeGroup) {
  TempDir t;
  // rank 0 fails while TORCHELASTIC_RESTART_COUNT < 2: two restarts are needed.
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --max_restarts 2 " + kProbe +
                   " --fail_rank 0 --fail_while_restart_below 2 --sleep 0.3",
               t.path);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("restarting the group (restart 2 of 2)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"TORCHELASTIC_RESTART_COUNT\":\"2\""), std::string::npos) << r.out;
  r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --max_restarts 1 " + kProbe +
              " --fail_rank 0 --fail_while_restart_below 2 --exit_code 5",
          t.path);
  EXPECT_EQ(r.code, 5) << r.out;
}

TEST(Launch, DryRunPrintsThePlan) {
  TempDir t;
  t.write("hostfile", "# two nodes\nworker-0 slots=4\n\nworker-1 slots=4\n");
  auto r = run(env_prefix(t) + kLaunch + " --hostfile hostfile --include 'worker-0:1,3@worker-1' --launcher ssh"
                   " --dry_run train_bert --config c.json 2>/dev/null",
               t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = json::parse(r.out);
  EXPECT_EQ(j["world_size"], 6);
  EXPECT_EQ(j["master_addr"], "worker-0");
  EXPECT_EQ(j["master_port"], 29500);
  EXPECT_EQ(j["launcher"], "ssh");
  ASSERT_EQ(j["hosts"].size(), 2u);
  EXPECT_EQ(j["hosts"][0]["host"], "worker-0");
  EXPECT_EQ(j["hosts"][0]["slots"], json({1, 3}));
  EXPECT_EQ(j["hosts"][0]["ranks"], json({0, 1}));
  EXPECT_EQ(j["hosts"][1]["ranks"], json({2, 3, 4, 5}));
  EXPECT_EQ(j["hosts"][1]["local_ranks"], json({0, 1, 2, 3}));
  const std::string cmd = j["hosts"][1]["commands"][0];
  EXPECT_NE(cmd.find("--world_info worker-0:1,3@worker-1:0,1,2,3 --node_rank 1"), std::string::npos) << cmd;
  EXPECT_NE(cmd.find("-- train_bert --config c.json"), std::string::npos) << cmd;
  r = run(env_prefix(t) + kLaunch + " --hostfile hostfile --num_gpus 2 --launcher openmpi --dry_run prog 2>/dev/null", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto m = json::parse(r.out);
  EXPECT_NE(m["runner_command"].get<std::string>().find("mpirun -n 4 -hostfile"), std::string::npos);
  EXPECT_EQ(m["generated_hostfile"], "worker-0 slots=2\nworker-1 slots=2\n");
}

struct BadLaunch {
  const char* args;
  const char* expect;
};
// What ctest shows after the case's name (CMake 3.25 puts GetParam()'s print into it).
void PrintTo(const BadLaunch& c, std::ostream* os) { *os << c.args; }

class LaunchErrors : public ::testing::TestWithParam<BadLaunch> {};

TEST_P(LaunchErrors, OneLineExitTwo) {
  TempDir t;
  t.write("hostfile", "worker-0 slots=2\nworker-1 slots 2\n");
  t.write("good", "localhost slots=2\n");
  const auto c = GetParam();
  auto r = run(env_prefix(t) + "PATH=/usr/bin:/bin " + kLaunch + " " + c.args, t.path);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.rfind("error: ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Table, LaunchErrors,
    ::testing::Values(BadLaunch{"--hostfile hostfile prog", "hostfile:2: bad hostfile entry 'worker-1 slots 2'"},
                      BadLaunch{"--hostfile missing prog", "hostfile 'missing' cannot be read"},
                      BadLaunch{"--hostfile good --include localhost:0 --num_gpus 1 prog", "--num_nodes/--num_gpus cannot be combined"},
                      BadLaunch{"--hostfile good --include localhost:5 prog", "host 'localhost' has no slot 5"},
                      BadLaunch{"--hostfile good --launcher pdsh prog", "'pdsh' is not installed"},
                      BadLaunch{"--hostfile good --launcher slurm prog", "'srun' is not installed"},
                      BadLaunch{"--num_gpus 2 no-such-program-xyz", "program 'no-such-program-xyz' is not on PATH"},
                      BadLaunch{"--num_gpus 2", "no PROGRAM given"},
                      BadLaunch{"--bogus_flag 1 prog", "command line: unknown option '--bogus_flag'"},
                      BadLaunch{"--launcher telnet prog", "command line:"}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// Stand-ins for ssh and pdsh: run the remote command here, so the per-node launcher path
// (--world_info, --node_rank, exports, exit codes) is exercised for real.
void write_fake_runners(const TempDir& t) {
  fs::create_directories(t.path / "bin");
  t.write("bin/ssh", "#!/bin/sh\n# fake ssh: the last argument is the remote command\nfor a; do cmd=$a; done\nexec sh -c \"$cmd\"\n", true);
  t.write("bin/pdsh",
          "#!/bin/bash\n# fake pdsh: run the command once per -w host, %n = the host's index\n"
          "while [ $# -gt 1 ]; do case \"$1\" in -w) hosts=$2; shift 2;; -f) shift 2;; *) shift;; esac; done\n"
          "IFS=, read -ra hs <<< \"$hosts\"; i=0; pids=()\n"
          "for h in \"${hs[@]}\"; do bash -c \"${1//%n/$i}\" & pids+=($!); i=$((i+1)); done\n"
          "rc=0; for p in \"${pids[@]}\"; do wait $p || rc=$?; done; exit $rc\n",
          true);
  t.write("hostfile", "nodeA slots=2\nnodeB slots=1\n");
}

class RemoteRunner : public ::testing::TestWithParam<const char*> {};

TEST_P(RemoteRunner, RunsEveryNodeAndPropagatesFailure) {
  TempDir t;
  write_fake_runners(t);
  const std::string path = "PATH='" + (t.path / "bin").string() + "':/usr/bin:/bin ";
  const std::string base = env_prefix(t) + path + kLaunch + " --hostfile hostfile --launcher " + GetParam() + " " + kProbe;
  auto r = run(base + " --lines 1", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 3u) << r.out;
  EXPECT_EQ(p[2]["env"]["RANK"], "2");
  EXPECT_EQ(p[2]["env"]["LOCAL_RANK"], "0");
  EXPECT_EQ(p[2]["env"]["CROSS_RANK"], "1");
  EXPECT_EQ(p[2]["env"]["WORLD_SIZE"], "3");
  EXPECT_EQ(p[1]["env"]["MASTER_ADDR"], "nodeA");
  r = run(base + " --fail_rank 2 --exit_code 9 --fail_after 0.5 --sleep 60", t.path);
  EXPECT_EQ(r.code, 9) << r.out;
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.out.find("rank 2 (host nodeB) (pid"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Runners, RemoteRunner, ::testing::Values("ssh", "pdsh"));

// Two "hosts" (127.0.0.2 and 127.0.0.3) served by a real OpenSSH server this test starts on
// loopback: the ssh runner starts a per-node launcher on each, ranks are global, a failing
// rank on one host ends the job with its code, and the other host's workers (and their
// children) are stopped through the runner: nothing is left behind.
TEST(Launch, TwoHostsThroughARealSshServer) {
  TempDir t;
  PT_SKIP_UNLESS(::geteuid() == 0, "root (the test starts its own sshd on 127.0.0.2-3)");
  PT_SKIP_UNLESS(fs::exists("/usr/sbin/sshd") && run("command -v ssh-keygen", t.path).code == 0,
                 "/usr/sbin/sshd and ssh-keygen (Debian openssh-server)");
  const std::string d = t.path.string();
  const int port = 20000 + ::getpid() % 20000;
  ASSERT_EQ(run("ssh-keygen -q -t ed25519 -N '' -f hk && ssh-keygen -q -t ed25519 -N '' -f uk && cp uk.pub keys && "
                "chmod 600 keys && mkdir -p /run/sshd pids",
                t.path).code, 0);
  t.write("sshd_config", "Port " + std::to_string(port) + "\nListenAddress 127.0.0.2\nListenAddress 127.0.0.3\n"
          "HostKey " + d + "/hk\nAuthorizedKeysFile " + d + "/keys\nPidFile " + d + "/sshd.pid\n"
          "UsePAM no\nStrictModes no\nPermitRootLogin yes\nPasswordAuthentication no\n");
  ASSERT_EQ(run("/usr/sbin/sshd -f " + d + "/sshd_config", t.path).code, 0);  // daemonizes; pid in sshd.pid
  struct StopSshd {
    std::string pidfile;
    ~StopSshd() {
      std::ifstream f(pidfile);
      int pid = 0;
      if (!(f >> pid) || pid <= 0) return;
      ::kill(pid, SIGTERM);
      // sshd deletes its pid file on the way out; wait for that so the temp dir is not
      // removed under it.
      for (int i = 0; i < 50 && fs::exists(pidfile); ++i) ::usleep(100000);
    }
  } stop{d + "/sshd.pid"};
  for (int i = 0; i < 50 && !fs::exists(t.path / "sshd.pid"); ++i) ::usleep(100000);
  t.write("hostfile", "127.0.0.2 slots=2\n127.0.0.3 slots=1\n");
  const std::string args = "--launcher_args '-p " + std::to_string(port) + " -i " + d +
                           "/uk -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes "
                           "-o LogLevel=ERROR'";
  const std::string base = env_prefix(t) + kLaunch + " --hostfile hostfile --launcher ssh " + args + " " + kProbe;
  auto r = run(base + " --lines 1", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 3u) << r.out;
  EXPECT_EQ(p[2]["env"]["RANK"], "2");
  EXPECT_EQ(p[2]["env"]["CROSS_RANK"], "1");
  EXPECT_EQ(p[0]["env"]["WORLD_SIZE"], "3");
  r = run(base + " --fail_rank 2 --exit_code 6 --fail_after 1 --sleep 60 --grandchild --pid_dir pids", t.path);
  EXPECT_EQ(r.code, 6) << r.out;
  EXPECT_LT(r.seconds, 20.0) << r.out;
  EXPECT_NE(r.out.find("rank 2 (host 127.0.0.3)"), std::string::npos) << r.out;
  expect_all_dead(t.path / "pids");  // host 127.0.0.2's sleepers included
}

TEST(Launch, OpenMpiWorkersMapOmpiVariables) {
  TempDir t;
  PT_SKIP_UNLESS(run("command -v mpirun", t.path).code == 0, "mpirun on PATH (Debian openmpi-bin)");
  t.write("hostfile", "localhost slots=4\n");
  auto r = run(env_prefix(t) + kLaunch + " --hostfile hostfile --launcher openmpi " + kProbe + " --lines 1", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  std::map<int, json> seen;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("probe {");
    if (at != std::string::npos) {
      auto j = json::parse(line.substr(at + 6));
      seen[j["dist"]["rank"].get<int>()] = j;
    }
  }
  ASSERT_EQ(seen.size(), 4u) << r.out;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(seen[rank]["dist"]["source"], "openmpi");
    EXPECT_EQ(seen[rank]["dist"]["world_size"], 4);
    EXPECT_EQ(seen[rank]["dist"]["local_rank"], rank);
  }
  EXPECT_EQ(seen[1]["env"]["MASTER_PORT"], "29500");
  EXPECT_NE(r.out.find("[1,3]<stdout>:"), std::string::npos) << r.out;  // rank-tagged output
  r = run(env_prefix(t) + kLaunch + " --launcher openmpi --num_gpus 2 " + kProbe +
              " --fail_rank 1 --exit_code 4 --fail_after 0.3 --sleep 60",
          t.path);
  EXPECT_EQ(r.code, 4) << r.out;
  EXPECT_LT(r.seconds, 20.0);
}

// The restart story end to end: a worker SIGKILLed after its first checkpoint is restarted
// by --max_restarts and continues from that checkpoint (--load_dir = --save_dir).
TEST(Launch, RestartResumesTrainingFromTheLastCheckpoint) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t;
  const std::string ckpt = (t.path / "ckpt").string();
  const std::string cmd = "cd " POLYTRAIN_SOURCE_DIR " && " + env_prefix(t) + kLaunch +
                          " --num_gpus 1 --max_restarts 1 train_bert --config configs/bert_tiny.json --max_steps 30"
                          " --save_interval 10 --eval_interval 1000 --log_interval 10 --no_progress_bar"
                          " --experiments_dir '" + (t.path / "exp").string() + "' --save_dir '" + ckpt +
                          "' --load_dir '" + ckpt + "'";
  // Kill the worker (not the launcher) once global_step10 is complete.
  // (The $ of the inner shell's variables is escaped from the outer one's double quotes.)
  auto r = run("sh -c \"(" + cmd + ") > out.txt 2>&1 & l=\\$!; "
               "while [ ! -f '" + ckpt + "/latest' ] && kill -0 \\$l 2>/dev/null; do sleep 0.2; done; "
               "pkill -9 -f '^[^ ]*/train_bert .*" + ckpt + "'; wait \\$l; echo launch_rc=\\$?; cat out.txt\"",
               t.path);
  EXPECT_NE(r.out.find("launch_rc=0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no checkpoint in " + ckpt + " yet: starting at step 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("was killed by signal 9"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("restarting the group (restart 1 of 1)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + ckpt + "/global_step"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "global_step30")) << r.out;
}

}  // namespace
