// `launch` as users run it, with tests/helpers/launch_probe as the worker: the environment
// each rank gets, rank-prefixed output and log files, .deepspeed_env, a failing rank stopping
// the group with its exit code (SIGKILL after the grace period, no orphans left), SIGINT and
// SIGTERM to the launcher, --max_restarts, --pid_file, --dry_run JSON, bad input, the ssh and
// pdsh runners end to end through stand-ins that run the remote command on this machine, and
// the rule that nothing (launcher or test) signals a process it did not start.
#include <string>

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "helpers/free_port.h"
#include "helpers/own_process.h"
#include "helpers/require.h"
#include "helpers/shipped_config.h"
#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/cpu_budget.h"
#include "polytrain/launcher/mpi_world.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using polytrain::testing::OwnProcess;
using polytrain::testing::wait_until;

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

struct SignalCase {
  const char* name;
  int sig;
  int code;
};
void PrintTo(const SignalCase& c, std::ostream* os) { *os << c.name; }

class LauncherSignal : public ::testing::TestWithParam<SignalCase> {};

int files_in(const fs::path& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  return n;
}

TEST_P(LauncherSignal, StopsWorkersAndExitsWith128PlusSignal) {
  TempDir t;
  fs::create_directories(t.path / "pids");
  const auto c = GetParam();
  const auto t0 = std::chrono::steady_clock::now();
  // The launcher is this test's own child (`exec` keeps the pid), signalled before it is reaped.
  OwnProcess launch("exec " + env_prefix(t) + kLaunch + " --num_gpus 2 --pid_file group.pids " + kProbe +
                        " --sleep 60 --grandchild --pid_dir pids",
                    t.path.string(), (t.path / "out.txt").string());
  // Supervising (the pid file comes after its signal handlers) and both grandchildren forked.
  ASSERT_TRUE(wait_until([&] { return (fs::exists(t.path / "group.pids") && files_in(t.path / "pids") == 4) || !launch.running(); }, 30));
  ASSERT_TRUE(launch.signal(c.sig)) << launch.output();
  EXPECT_EQ(launch.wait(), c.code) << launch.output();
  EXPECT_NE(launch.output().find(std::string("launch: received ") + strsignal(c.sig) + "; stopped 2 process(es)"), std::string::npos)
      << launch.output();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  EXPECT_FALSE(fs::exists(t.path / "group.pids"));  // removed with the group
  expect_all_dead(t.path / "pids");
}

INSTANTIATE_TEST_SUITE_P(Signals, LauncherSignal,
                         ::testing::Values(SignalCase{"INT", SIGINT, 130}, SignalCase{"TERM", SIGTERM, 143}),
                         [](const auto& info) { return std::string(info.param.name); });

#if defined(__SANITIZE_ADDRESS__)
// LeakSanitizer cannot run in a traced process ("LeakSanitizer does not work under ptrace"):
// what strace follows runs without it (every other launcher test checks the same programs).
const std::string kUnderStrace = "ASAN_OPTIONS=detect_leaks=0 ";
#else
const std::string kUnderStrace;
#endif

// A group stopped right after it started: a rank fails at once while the launcher's newest
// children are still between fork() and exec(). strace keeps each child there for 0.8 s
// (prctl delayed) and spaces the forks (pipe2 delayed), so that the SIGTERM to those
// children's groups lands in that window every time. It used to run the launcher's own
// handler in the child, which wrote SIGTERM into the signal pipe it still shared with the
// launcher: the launcher took it for a signal to itself ("launch: received Terminated",
// exit 143) and gave up instead of restarting, as MaxRestartsRestartsTheWholeGroup did
// under load in CI.
TEST(Launch, GroupStoppedBeforeItsProcessesExecIsStillRestarted) {
  TempDir t;
  PT_SKIP_UNLESS(run("command -v strace", t.path).code == 0, "strace on PATH (Debian strace)");
  auto r = run(env_prefix(t) + kUnderStrace + "strace -f -qq -o trace.txt -e trace=pipe2,prctl -e inject=pipe2:delay_enter=150000"
               " -e inject=prctl:delay_enter=800000 " + kLaunch + " --num_gpus 4 --max_restarts 1 " + kProbe +
               " --fail_rank 0 --fail_while_restart_below 1 --sleep 0.3",
               t.path);
  std::ifstream trace(t.path / "trace.txt");
  std::stringstream ss;
  ss << trace.rdbuf();
  PT_SKIP_UNLESS(ss.str().find("PR_SET_PDEATHSIG") != std::string::npos, "strace able to trace here: " + r.out);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("restarting the group (restart 1 of 1)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("launch: received"), std::string::npos) << r.out;
}

// --pid_file: while the group runs it lists every worker with its start time (what a test, or
// a user's script, needs to signal exactly that process and no later owner of its pid).
TEST(Launch, PidFileListsTheRunningGroup) {
  TempDir t;
  fs::create_directories(t.path / "pids");
  OwnProcess launch("exec " + env_prefix(t) + kLaunch + " --num_gpus 2 --pid_file group.pids " + kProbe +
                        " --sleep 60 --fail_rank 1 --exit_code 0 --pid_dir pids",
                    t.path.string(), (t.path / "out.txt").string());
  ASSERT_TRUE(wait_until([&] { return probes(launch.output()).size() == 2 || !launch.running(); }, 30)) << launch.output();
  const auto listed = polytrain::testing::read_pid_file((t.path / "group.pids").string());
  ASSERT_EQ(listed.size(), 2u) << launch.output();
  auto p = probes(launch.output());
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(listed[rank].label, "rank " + std::to_string(rank) + " (host localhost)");
    EXPECT_EQ(listed[rank].pid, p[rank]["pid"].get<int>());
  }
  // Rank 1 has exited (reaped by the launcher): its entry no longer matches anything, so
  // nothing is signalled even if its pid were reused by now.
  ASSERT_TRUE(wait_until([&] { return polytrain::launcher::process_start_time(listed[1].pid) != listed[1].start_time; }, 10));
  EXPECT_FALSE(polytrain::testing::signal_listed(listed[1], SIGTERM));
  EXPECT_EQ(polytrain::launcher::process_start_time(listed[0].pid), listed[0].start_time);
  EXPECT_TRUE(polytrain::testing::signal_listed(listed[0], SIGKILL));
  EXPECT_EQ(launch.wait(), 137) << launch.output();
  EXPECT_NE(launch.output().find("rank 0 (host localhost) (pid " + std::to_string(listed[0].pid) + ") was killed by signal 9"),
            std::string::npos) << launch.output();
  EXPECT_FALSE(fs::exists(t.path / "group.pids"));  // gone with the group: its pids are free
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 1 --pid_file no/such/dir/p " + kProbe, t.path);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.rfind("error: --pid_file: cannot write 'no/such/dir/p': No such file or directory", 0), 0u) << r.out;
}

// One process's calls from an `strace -f` log, unfinished/resumed halves joined.
struct TracedCall {
  int pid;
  std::string name, args;
  long ret;
  std::string tail;
};

std::vector<TracedCall> read_strace(const fs::path& file) {
  std::vector<TracedCall> calls;
  std::map<int, std::string> pending;
  std::ifstream in(file);
  const std::regex line_re(R"(^(\d+) +(.*)$)"), call_re(R"(^(\w+)\((.*)\) += (-?\d+)(.*)$)"),
      resumed_re(R"(^<\.\.\. \w+ resumed>(.*)$)");
  std::smatch m;
  for (std::string line; std::getline(in, line);) {
    if (!std::regex_match(line, m, line_re)) continue;
    const int pid = std::stoi(m[1]);
    std::string text = m[2];
    const std::string unfinished = " <unfinished ...>";
    if (text.size() > unfinished.size() && text.compare(text.size() - unfinished.size(), unfinished.size(), unfinished) == 0) {
      pending[pid] = text.substr(0, text.size() - unfinished.size());
      continue;
    }
    if (std::regex_match(text, m, resumed_re)) text = pending[pid] + m[1].str();
    if (std::regex_match(text, m, call_re)) calls.push_back({pid, m[1], m[2], std::stol(m[3]), m[4]});
  }
  return calls;
}

// The launcher signals only what it started: traced while it stops a group the hard way (a
// rank fails, the survivors ignore SIGTERM, each has a grandchild in its group and one that
// left it for its own session), every signal it sends goes to a process, or the group of a
// process, that descends from it and that it has not reaped, and finds it there (no ESRCH):
// a pid it no longer holds may belong to anyone by then.
TEST(Launch, SignalsOnlyProcessesItStartedAndHasNotReaped) {
  TempDir t;
  PT_SKIP_UNLESS(run("command -v strace", t.path).code == 0, "strace on PATH (Debian strace)");
  fs::create_directories(t.path / "pids");
  auto r = run(env_prefix(t) + kUnderStrace + "strace -f -qq -o trace.txt -e trace=kill,tkill,tgkill,pidfd_send_signal,clone,clone3,fork,vfork,"
               "wait4,waitid,execve -e signal=none " + kLaunch + " --num_gpus 3 --term_timeout 1 " + kProbe +
               " --fail_rank 1 --exit_code 7 --fail_after 0.5 --sleep 60 --ignore_term --grandchild --detached_grandchild"
               " --pid_dir pids",
               t.path);
  const auto calls = read_strace(t.path / "trace.txt");
  PT_SKIP_UNLESS(!calls.empty(), "strace able to trace here: " + r.out);
  EXPECT_EQ(r.code, 7) << r.out;
  int launcher = -1;  // the process that ran `launch`
  for (const auto& c : calls)
    if (launcher < 0 && c.name == "execve" && c.ret == 0 && c.args.rfind("\"" + kLaunch + "\"", 0) == 0) launcher = c.pid;
  ASSERT_GT(launcher, 0) << "no execve of " << kLaunch << " in the trace";
  std::map<int, int> parent;  // process -> the process that forked it
  std::set<int> reaped;       // by the launcher
  int group_kills = 0, sigkills = 0, pid_kills = 0;
  auto descends = [&](int p) {
    for (int hops = 0; parent.count(p) && hops < 100; ++hops)
      if ((p = parent[p]) == launcher) return true;
    return false;
  };
  for (const auto& c : calls) {
    const bool fork = c.name == "clone" || c.name == "clone3" || c.name == "fork" || c.name == "vfork";
    if (fork && c.ret > 0 && c.args.find("CLONE_THREAD") == std::string::npos) parent[static_cast<int>(c.ret)] = c.pid;
    if ((c.name == "wait4" || c.name == "waitid") && c.pid == launcher && c.ret > 0) reaped.insert(static_cast<int>(c.ret));
    if (c.pid != launcher || (c.name != "kill" && c.name != "tkill" && c.name != "tgkill" && c.name != "pidfd_send_signal")) continue;
    const std::string call = c.name + "(" + c.args + ") = " + std::to_string(c.ret) + c.tail;
    ASSERT_EQ(c.name, "kill") << call;
    const int target = std::stoi(c.args);
    const std::string sig = c.args.substr(c.args.find(',') + 2);
    if (sig == "0") continue;
    EXPECT_TRUE(descends(std::abs(target))) << call << ": not a process the launcher started";
    EXPECT_FALSE(reaped.count(std::abs(target))) << call << ": already reaped by the launcher";
    EXPECT_EQ(c.ret, 0) << call;
    group_kills += target < 0;
    pid_kills += target > 0;
    sigkills += sig == "SIGKILL";
  }
  EXPECT_GE(group_kills, 2) << "SIGTERM to the survivors' groups";
  EXPECT_GE(sigkills, 2) << "SIGKILL after --term_timeout";
  EXPECT_GE(pid_kills, 2) << "the detached grandchildren, stopped by pid once re-parented to the launcher";
  expect_all_dead(t.path / "pids");
}

// Tests end their own processes by pid (helpers/own_process.h), never by a name pattern: a
// pattern also matches what another test, or another user, runs on the same machine.
TEST(Launch, TestsNeverSignalProcessesByName) {
  const std::vector<std::string> by_name = {std::string("pk") + "ill ", std::string("kill") + "all "};
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(POLYTRAIN_SOURCE_DIR) / "tests")) {
    const auto ext = e.path().extension();
    if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".sh" && ext != ".py")) continue;
    ++files;
    std::ifstream in(e.path());
    int n = 0;
    for (std::string line; std::getline(in, line);) {
      ++n;
      const auto code = line.find_first_not_of(" \t");
      if (code == std::string::npos || line.compare(code, 2, "//") == 0 || line[code] == '#') continue;  // prose
      for (const auto& w : by_name)
        EXPECT_EQ(line.find(w), std::string::npos) << e.path().string() << ":" << n << " signals by name: " << line;
    }
  }
  EXPECT_GT(files, 10);
}

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

// On one host the ranks get what makes them one MPI job without mpirun (the launcher serves PMIx;
// tests/mpi_collectives.cpp runs the collectives over it): each its PMIx rank, one namespace
// per attempt (a restarted group is a new job), none with --no_mpi_world or a single rank.
TEST(Launch, RanksOnOneHostAreOneMpiJobAndEachRestartANewOne) {
  PT_SKIP_UNLESS(polytrain::launcher::mpi_world_supported(), "a launcher built with PMIx (libpmix-dev)");
  TempDir t;
  auto r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --max_restarts 1 " + kProbe +
                   " --fail_rank 1 --fail_while_restart_below 1 --fail_after 0.5 --sleep 0.3",
               t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("MPI world through this launcher's PMIx server"), std::string::npos) << r.out;
  std::map<std::string, std::set<int>> ranks_by_job;  // attempt's namespace -> PMIx ranks seen
  std::map<std::string, std::set<std::string>> jobs_by_attempt;
  std::istringstream in(r.out);
  std::string line;
  const std::regex re(R"(^\[rank (\d+)\] probe (\{.*\})$)");
  std::smatch sm;
  while (std::getline(in, line)) {
    if (!std::regex_match(line, sm, re)) continue;
    const auto j = json::parse(sm[2].str());
    ASSERT_TRUE(j["env"].contains("PMIX_NAMESPACE")) << line;
    EXPECT_EQ(j["env"]["POLYTRAIN_MPI_WORLD"], "pmix");
    EXPECT_EQ(j["env"]["PMIX_RANK"], sm[1].str());
    ranks_by_job[j["env"]["PMIX_NAMESPACE"]].insert(std::stoi(sm[1]));
    jobs_by_attempt[j["env"]["TORCHELASTIC_RESTART_COUNT"]].insert(j["env"]["PMIX_NAMESPACE"]);
    // Open MPI's per-job folders (shared-memory segments on tmpfs, session files) are gone
    // with the job, whether its ranks finished MPI_Finalize or not.
    for (const char* k : {"OMPI_MCA_btl_vader_backing_directory", "OMPI_MCA_orte_tmpdir_base"}) {
      ASSERT_TRUE(j["env"].contains(k)) << line;
      const std::string dir = j["env"][k];
      EXPECT_NE(dir.find(j["env"]["PMIX_NAMESPACE"].get<std::string>()), std::string::npos) << dir;
      EXPECT_FALSE(fs::exists(dir)) << dir;
    }
  }
  // One job per attempt, each its own (rank 0 of the first may be stopped before it prints).
  ASSERT_EQ(jobs_by_attempt.size(), 2u) << r.out;
  ASSERT_EQ(ranks_by_job.size(), 2u) << r.out;
  for (const auto& [attempt, jobs] : jobs_by_attempt) EXPECT_EQ(jobs.size(), 1u) << attempt;
  EXPECT_EQ(ranks_by_job[*jobs_by_attempt["1"].begin()], std::set<int>({0, 1})) << r.out;
  for (const std::string flags : {"--num_gpus 2 --no_mpi_world", "--num_gpus 1"}) {
    r = run(env_prefix(t) + kLaunch + " " + flags + " " + kProbe, t.path);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto p = probes(r.out);
    ASSERT_FALSE(p.empty()) << r.out;
    for (const auto& [rank, j] : p) EXPECT_FALSE(j["env"].contains("PMIX_NAMESPACE")) << flags << ": " << r.out;
  }
  r = run(env_prefix(t) + kLaunch + " --num_gpus 2 --dry_run prog 2>/dev/null", t.path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["mpi_world"], "pmix");
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
  EXPECT_NE(cmd.find("--node_host worker-1 --node_rank 1 --node_slots 0-3 --rank_offset 2 --world_size 6 --num_nodes_total 2"),
            std::string::npos)
      << cmd;
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
                      BadLaunch{"--bogus_flag 1 prog", "unknown flag --bogus_flag (see --help)"},
                      BadLaunch{"--num_gpu 2 prog", "unknown flag --num_gpu; did you mean --num_gpus?"},
                      BadLaunch{"--launcher telnet prog", "command line:"}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// Stand-ins for ssh and pdsh: run the remote command here, so the per-node launcher path
// (--node_slots / --slot_layout, --node_rank, exports, exit codes) is exercised for real.
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
  // pdsh runs one command everywhere: its per-node launcher names the host by its own name
  // (real pdsh prefixes every line with the host it came from).
  EXPECT_NE(r.out.find(GetParam() == std::string("ssh") ? "rank 2 (host nodeB) (pid" : "rank 2 (host "), std::string::npos)
      << r.out;
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
  // sshd in the foreground (-D) as this test's own child: stopped through that pid, which
  // cannot be anyone else's before it is reaped (a daemon's pid file can name a stranger once
  // the daemon is gone).
  OwnProcess sshd("exec /usr/sbin/sshd -D -e -f " + d + "/sshd_config", d, d + "/sshd.log", SIGTERM);
  ASSERT_TRUE(wait_until([&] { return fs::exists(t.path / "sshd.pid") || !sshd.running(); }, 10)) << sshd.output();
  ASSERT_TRUE(sshd.running()) << sshd.output();
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

// The processes whose process-group id is `pgid`.
std::vector<int> group_members(int pgid) {
  std::vector<int> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat;
    std::getline(f, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    int ppid = 0, pgrp = 0;
    if (rest >> state >> ppid >> pgrp && pgrp == pgid) out.push_back(std::stoi(name));
  }
  return out;
}

// `launch --hold_pid` (what mpirun runs for each rank): after the rank has ended and its
// parent (mpirun; here a shell standing in for it) has reaped it, its pid stays allocated,
// held as a process-group id, until that parent exits; so a signal mpirun sends to that pid
// late finds nothing (ESRCH) instead of a process that was given the pid since. The rank's
// exit code, or the signal that killed it, is the holder's.
TEST(Launch, HoldPidKeepsAReapedRanksPidUntilItsRunnerExits) {
  TempDir t;
  OwnProcess runner("exec sh -c '" + kLaunch + " --hold_pid -- sh -c \"exit 3\" & echo holder=$!; wait $!; echo rc=$?; " +
                        kLaunch + " --hold_pid -- sh -c \"kill -TERM \\$\\$\"; echo rc=$?; "
                        "touch checked; while [ ! -f done ]; do sleep 0.05; done'",
                    t.path.string(), (t.path / "out.txt").string());
  ASSERT_TRUE(wait_until([&] { return fs::exists(t.path / "checked") || !runner.running(); }, 20)) << runner.output();
  const std::string out = runner.output();
  EXPECT_NE(out.find("rc=3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("rc=143\n"), std::string::npos) << out;  // killed by SIGTERM, like its PROGRAM
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("holder=([0-9]+)"))) << out;
  const int holder = std::stoi(m[1]);
  errno = 0;
  EXPECT_EQ(::getpgid(holder), -1) << "the holder has been reaped";
  EXPECT_EQ(errno, ESRCH);
  EXPECT_EQ(group_members(holder).size(), 1u) << "its keeper holds the pid as a group id";
  t.write("done", "");
  EXPECT_EQ(runner.wait(), 0) << runner.output();
  EXPECT_TRUE(wait_until([&] { return group_members(holder).empty(); }, 10)) << "the keeper outlived its runner";
}

// The restart story end to end: a worker SIGKILLed after its first checkpoint is restarted
// by --max_restarts and continues from that checkpoint (--load_dir = --save_dir).
TEST(Launch, RestartResumesTrainingFromTheLastCheckpoint) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t;
  const std::string ckpt = (t.path / "ckpt").string();
  const std::string pids = (t.path / "group.pids").string();
  OwnProcess launch("exec " + env_prefix(t) + kLaunch + " --num_gpus 1 --max_restarts 1 --pid_file '" + pids +
                        "' train_bert --config configs/bert_tiny.json --max_steps 30 --save_interval 10"
                        " --eval_interval 1000 --log_interval 10 --no_progress_bar --experiments_dir '" +
                        (t.path / "exp").string() + "' --save_dir '" + ckpt + "' --load_dir '" + ckpt + "'",
                    POLYTRAIN_SOURCE_DIR, (t.path / "out.txt").string());
  // Kill the worker (not the launcher) once global_step10 is complete: by the pid the
  // launcher lists for it, checked to be still that process.
  ASSERT_TRUE(wait_until([&] { return fs::exists(fs::path(ckpt) / "latest") || !launch.running(); }, 500)) << launch.output();
  ASSERT_TRUE(launch.running()) << launch.output();
  EXPECT_TRUE(polytrain::testing::signal_listed(polytrain::testing::find_listed(pids, "rank 0 "), SIGKILL)) << launch.output();
  EXPECT_EQ(launch.wait(), 0) << launch.output();
  const std::string out = launch.output();
  EXPECT_NE(out.find("no checkpoint in " + ckpt + " yet: starting at step 0"), std::string::npos) << out;
  EXPECT_NE(out.find("was killed by signal 9"), std::string::npos) << out;
  EXPECT_NE(out.find("restarting the group (restart 1 of 1)"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "/global_step"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "global_step30")) << out;
}

// ---- threads: all the CPUs by default, split among the workers the launcher starts ----------
TEST(Threads, DefaultRulesAffinityAndQuota) {
  // Each case in a child process: the environment and the affinity mask are its own.
  auto in_child = [](const std::function<int()>& body) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(body());
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const int cpus = polytrain::available_cpus();
  EXPECT_GE(cpus, 1);
  EXPECT_EQ(in_child([] {
              ::unsetenv("OMP_NUM_THREADS");
              for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"}) ::unsetenv(k);
              std::string why;
              const int n = polytrain::default_thread_count(0, &why);
              std::printf("alone: %d (%s)\n", n, why.c_str());
              return n == polytrain::available_cpus() && why.find("/ 1 local process") != std::string::npos ? 0 : 1;
            }),
            0);
  EXPECT_EQ(in_child([] {  // configured wins over OMP_NUM_THREADS, which wins over the split
              ::setenv("OMP_NUM_THREADS", "3", 1);
              if (polytrain::default_thread_count(5) != 5) return 1;
              if (polytrain::default_thread_count(0) != 3) return 2;
              ::setenv("OMP_NUM_THREADS", "4,2", 1);  // OpenMP's nesting list: the first level
              if (polytrain::default_thread_count(0) != 4) return 3;
              ::setenv("OMP_NUM_THREADS", "zero", 1);  // not a count: ignored
              ::setenv("RANK", "1", 1), ::setenv("WORLD_SIZE", "4", 1), ::setenv("LOCAL_WORLD_SIZE", "2", 1);
              return polytrain::default_thread_count(0) == std::max(1, polytrain::available_cpus() / 2) ? 0 : 4;
            }),
            0);
  EXPECT_EQ(in_child([] {  // one CPU in the affinity mask: one thread
              cpu_set_t one;
              CPU_ZERO(&one);
              CPU_SET(0, &one);
              if (::sched_setaffinity(0, sizeof one, &one) != 0) return 1;
              ::unsetenv("OMP_NUM_THREADS");
              ::unsetenv("LOCAL_WORLD_SIZE"), ::unsetenv("WORLD_SIZE"), ::unsetenv("RANK");
              return polytrain::available_cpus() == 1 && polytrain::default_thread_count(0) == 1 ? 0 : 2;
            }),
            0);
  // cgroup quotas, v2 (the smallest on the way to the root) and v1, from files laid out as
  // /proc/self/cgroup and /sys/fs/cgroup show them.
  TempDir t;
  fs::create_directories(t.path / "v2/job/step");
  std::ofstream(t.path / "v2/job/cpu.max") << "150000 100000\n";
  std::ofstream(t.path / "v2/job/step/cpu.max") << "max 100000\n";
  std::ofstream(t.path / "self_v2") << "0::/job/step\n";
  EXPECT_DOUBLE_EQ(polytrain::cgroup_cpu_quota_from((t.path / "self_v2").string(), (t.path / "v2").string()), 1.5);
  fs::create_directories(t.path / "v1/cpu,cpuacct/docker/abc");
  std::ofstream(t.path / "v1/cpu,cpuacct/docker/abc/cpu.cfs_quota_us") << "300000\n";
  std::ofstream(t.path / "v1/cpu,cpuacct/docker/abc/cpu.cfs_period_us") << "100000\n";
  std::ofstream(t.path / "self_v1") << "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n";
  EXPECT_DOUBLE_EQ(polytrain::cgroup_cpu_quota_from((t.path / "self_v1").string(), (t.path / "v1").string()), 3.0);
  std::ofstream(t.path / "self_none") << "0::/\n";  // the root: no cpu.max, no quota
  EXPECT_EQ(polytrain::cgroup_cpu_quota_from((t.path / "self_none").string(), (t.path / "v2").string()), 0.0);
}

TEST(Threads, ASingleRunUsesEveryCpuAndLaunchedWorkersSplitThem) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t;
  const int cpus = polytrain::available_cpus();
  const std::string train = "train_bert --config configs/bert_tiny.json --max_steps 1 --save_interval 0"
                            " --eval_interval 1000 --log_interval 1 --no_progress_bar --experiments_dir '" +
                            (t.path / "exp").string() + "'";
  // ctest sets OMP_NUM_THREADS=1 for every test: removed here, as on a user's shell.
  auto r = run("env -u OMP_NUM_THREADS HOME='" + t.path.string() + "' " + POLYTRAIN_BINARY_DIR "/" + train,
               POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  // The log's first line: threads, BLAS, the fp32 GEMM engine, allocator.
  const std::string first = r.out.substr(0, r.out.find('\n'));
  EXPECT_EQ(first.rfind("polytrain: threads " + std::to_string(cpus) + " (" + std::to_string(cpus) +
                            " CPUs / 1 local process) | BLAS ",
                        0),
            0u)
      << r.out;
  EXPECT_NE(first.find(" | fp32 GEMM "), std::string::npos) << first;
  EXPECT_NE(first.find(" | allocator "), std::string::npos) << first;
  // Two launched workers: the launcher gives each its share (torchrun's OMP_NUM_THREADS).
  r = run("env -u OMP_NUM_THREADS " + env_prefix(t) + kLaunch + " --num_gpus 2 --slot_type cpu " + kProbe, t.path);
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 2u) << r.out;
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(p[rank]["env"]["OMP_NUM_THREADS"], std::to_string(std::max(1, cpus / 2)));
  r = run("env -u OMP_NUM_THREADS " + env_prefix(t) + kLaunch + " --num_gpus 2 --master_port " +
              std::to_string(polytrain::testing::free_port()) + " " + train + " --env_type pytorchDDP --train_batch_size 32",
          POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[rank 0] polytrain: threads " + std::to_string(std::max(1, cpus / 2)) + " (OMP_NUM_THREADS)"),
            std::string::npos)
      << r.out;
}

// OpenBLAS's kernel: the first line names it and says why; a program whose OpenBLAS fell back
// to an old kernel executes itself again with the CPU's (OPENBLAS_CORETYPE), and the launcher
// sets it for its workers. The fall-back is made real with OPENBLAS_CORETYPE=Prescott (OpenBLAS
// then loads its SSE3 kernels) and POLYTRAIN_TEST_OPENBLAS_FALLBACK=1 (the variable then counts as
// OpenBLAS's own pick, not the user's).
TEST(Threads, AFallenBackOpenBlasKernelIsReplacedByTheCpusBestAndTheFirstLineSaysWhy) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  const auto want = polytrain::choose_openblas_core(polytrain::host_cpu_features(), "Prescott", nullptr);
  ASSERT_FALSE(want.coretype.empty()) << "this CPU has neither AVX nor AVX2: " << polytrain::describe_cpu(polytrain::host_cpu_features());
  TempDir t;
  const std::string train = std::string(POLYTRAIN_BINARY_DIR) + "/train_bert --config configs/bert_tiny.json --max_steps 1"
                            " --save_interval 0 --eval_interval 1000 --log_interval 1 --no_progress_bar --experiments_dir '" +
                            (t.path / "exp").string() + "'";
  auto first_line = [](const std::string& out) { return out.substr(0, out.find('\n')); };
  // As is: OpenBLAS's own pick on this machine, named.
  auto r = run("env -u OPENBLAS_CORETYPE -u POLYTRAIN_BLAS_KERNEL " + train, POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(first_line(r.out).find("[kernel "), std::string::npos) << r.out;
  // A fall-back: re-executed with the CPU's kernel, which OpenBLAS then runs; the step trains.
  r = run("env -u POLYTRAIN_BLAS_KERNEL OPENBLAS_CORETYPE=Prescott POLYTRAIN_TEST_OPENBLAS_FALLBACK=1 " + train,
          POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(first_line(r.out).find(" " + want.coretype + " "), std::string::npos) << "OpenBLAS's config:\n" << r.out;
  EXPECT_NE(first_line(r.out).find("[kernel " + want.coretype + ", chosen by polytrain: OpenBLAS picked Prescott for "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\nstep 1/"), std::string::npos) << r.out;
  // The user's own OPENBLAS_CORETYPE wins, and the line says it is theirs.
  r = run("env -u POLYTRAIN_BLAS_KERNEL OPENBLAS_CORETYPE=Prescott " + train, POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(first_line(r.out).find("[kernel Prescott, OPENBLAS_CORETYPE=Prescott from the environment"), std::string::npos)
      << r.out;
  // An SSE3 kernel on this CPU (AVX at least, asserted above) is named as older.
  EXPECT_NE(first_line(r.out).find("older than this CPU"), std::string::npos) << r.out;
  // The launcher chooses for its workers (each would otherwise re-execute itself).
  r = run("env -u POLYTRAIN_BLAS_KERNEL OPENBLAS_CORETYPE=Prescott POLYTRAIN_TEST_OPENBLAS_FALLBACK=1 " + env_prefix(t) +
              kLaunch + " --num_gpus 2 --slot_type cpu " + kProbe,
          t.path);
  auto p = probes(r.out);
  ASSERT_EQ(p.size(), 2u) << r.out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(p[rank]["env"]["OPENBLAS_CORETYPE"], want.coretype) << r.out;
    EXPECT_EQ(p[rank]["env"]["POLYTRAIN_BLAS_KERNEL"].get<std::string>().rfind(want.coretype + "|chosen by polytrain", 0), 0u)
        << r.out;
  }
}

// ---- fault injection (POLYTRAIN_FAULT, src/common/fault.h) ----------------------------------
// Two pytorchDDP ranks of tiny BERT under the launcher; rank 1 sends itself a signal at a chosen
// moment. The job must end within its deadline with the failing rank's code, leave no process
// behind (every pid the launcher listed, checked by pid and start time), and the last
// complete checkpoint must load.

struct Fault {
  const char* point;
  int hit;
  const char* signal;
  int expect_code;  // the launcher's exit code
  double deadline;  // seconds from the fault to the launcher's exit
};
void PrintTo(const Fault& f, std::ostream* os) { *os << f.point << ":" << f.hit << ":" << f.signal; }

class FaultInjection : public ::testing::TestWithParam<Fault> {};

TEST_P(FaultInjection, TheJobEndsInTimeLeavesNothingAndTheLastCheckpointLoads) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  const Fault f = GetParam();
  TempDir t;
  // comm_timeout 8 s: a rank stopped mid-all-reduce is found by its peer's deadline.
  json cfg = polytrain::testing::shipped_config("bert_tiny.json");
  cfg["trainer"]["comm_timeout"] = 8;
  cfg["trainer"]["keep_last"] = 2;
  cfg["data"]["eval_batches"] = 2;
  std::ofstream(t.path / "config.json") << cfg.dump(2);
  const std::string ckpt = (t.path / "ckpt").string();
  const std::string pids = (t.path / "group.pids").string();
  const std::string flags = " --train_batch_size 32 --save_interval 2 --eval_interval 3 --log_interval 1 --no_progress_bar"
                            " --num_threads 1 --experiments_dir '" + (t.path / "exp").string() + "'";
  OwnProcess launch("POLYTRAIN_FAULT=1:" + std::string(f.point) + ":" + std::to_string(f.hit) + ":" + f.signal +
                        " exec " + env_prefix(t) + kLaunch + " --num_gpus 2 --master_port " +
                        std::to_string(polytrain::testing::free_port()) + " --term_timeout 3 --pid_file '" + pids +
                        "' train_bert --config '" + (t.path / "config.json").string() +
                        "' --env_type pytorchDDP --save_dir '" + ckpt + "' --max_steps 8" + flags,
                    POLYTRAIN_SOURCE_DIR, (t.path / "out.txt").string());
  // The group's processes, as the launcher lists them while they run.
  std::vector<polytrain::testing::ListedProcess> listed;
  ASSERT_TRUE(wait_until([&] { return (listed = polytrain::testing::read_pid_file(pids)).size() >= 2 || !launch.running(); },
                         120))
      << launch.output();
  ASSERT_GE(listed.size(), 2u) << launch.output();
  // The fault: rank 1 says so on stderr before the signal.
  const std::string said = std::string("sends itself SIG") + f.signal + " at '" + f.point + "'";
  ASSERT_TRUE(wait_until([&] { return launch.output().find(said) != std::string::npos || !launch.running(); }, 240))
      << launch.output();
  ASSERT_NE(launch.output().find(said), std::string::npos) << launch.output();
  const auto t0 = std::chrono::steady_clock::now();
  const bool ended = wait_until([&] { return !launch.running(); }, f.deadline + 30);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(ended) << launch.output();
  const int code = launch.wait();
  const std::string out = launch.output();
  std::printf("[fault] rank 1 SIG%s at %s (pass %d): the launcher exited %d, %.1f s after the fault\n", f.signal,
              f.point, f.hit, code, took);
  EXPECT_EQ(code, f.expect_code) << out;
  EXPECT_LE(took, f.deadline) << out;
  EXPECT_FALSE(fs::exists(pids)) << "the launcher removes its pid file when the group has ended";
  for (const auto& p : listed) {  // gone, or the pid now belongs to another process
    EXPECT_NE(polytrain::launcher::process_start_time(p.pid), p.start_time) << p.label << " (pid " << p.pid << ") is left";
  }
  // The last complete checkpoint loads: one process resumes from `latest` and trains on.
  // (Killed in its third checkpoint file, rank 1 has completed at least one checkpoint.)
  if (std::string(f.point) == "checkpoint") ASSERT_TRUE(fs::exists(fs::path(ckpt) / "latest")) << out;
  if (!fs::exists(fs::path(ckpt) / "latest")) return;
  std::string latest;
  std::ifstream(fs::path(ckpt) / "latest") >> latest;
  auto r = run(env_prefix(t) + POLYTRAIN_BINARY_DIR "/train_bert --config '" + (t.path / "config.json").string() +
                   "' --env_type pytorch --save_dir '" + (t.path / "resumed").string() +
                   "' --load_dir '" + ckpt + "' --max_steps 9" + flags,
               POLYTRAIN_SOURCE_DIR);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + ckpt + "/" + latest), std::string::npos) << r.out;
}

// A malformed POLYTRAIN_FAULT ends the launcher and a training program before anything starts.
TEST(Launch, AMalformedFaultSpecIsExitCode2) {
  for (const std::string program : {kLaunch + " --num_gpus 1 train_bert", std::string(POLYTRAIN_BINARY_DIR "/train_bert")}) {
    auto r = run("POLYTRAIN_FAULT=1:nowhere:2 exec " + program + " --config configs/bert_tiny.json --max_steps 1",
                 POLYTRAIN_SOURCE_DIR);
    EXPECT_EQ(r.code, 2) << program << "\n" << r.out;
    EXPECT_NE(r.out.find("error: POLYTRAIN_FAULT='1:nowhere:2': expected RANK:POINT"), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "one line\n" << r.out;
  }
}

// ---- FlagAI's self-launching Trainer: a data-parallel program run on its own ---------------

// "rank R step N loss X" for every step line of the output (timings left out).
std::vector<std::string> step_losses(const std::string& out) {
  std::vector<std::string> v;
  std::istringstream in(out);
  std::string line;
  const std::regex re(R"(^\[rank (\d+)\] step (\d+)/\d+ .*\| loss ([0-9.]+) )");
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) v.push_back("rank " + m[1].str() + " step " + m[2].str() + " loss " + m[3].str());
  return v;
}

const std::string kSelfLaunchArgs =
    " --config configs/bert_tiny.json --env_type pytorchDDP --train_batch_size 32 --eval_interval 1000"
    " --save_interval 0 --log_interval 1 --no_progress_bar --num_threads 1";

// `train_bert --env_type pytorchDDP --num_gpus 2`, with no launcher, is `launch --num_gpus 2
// train_bert ...`: the same launch line, two ranks, the same losses; also when num_gpus (and
// env_type) come from the config's trainer section.
TEST(SelfLaunch, TwoProcessesFromAFlagOrTheTrainerSectionTrainAsUnderLaunch) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t;
  const std::string exp = " --max_steps 3 --experiments_dir '" + (t.path / "exp").string() + "'";
  const std::string port1 = std::to_string(polytrain::testing::free_port());
  auto launched = run(env_prefix(t) + kLaunch + " --num_gpus 2 --master_port " + port1 + " train_bert" + kSelfLaunchArgs + exp,
                      POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(launched.code, 0) << launched.out;
  const auto expect = step_losses(launched.out);
  ASSERT_EQ(expect.size(), 3u) << launched.out;

  const std::string port2 = std::to_string(polytrain::testing::free_port());
  auto self = run(env_prefix(t) + POLYTRAIN_BINARY_DIR "/train_bert" + kSelfLaunchArgs + exp + " --num_gpus 2 --master_port " + port2,
                  POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(self.code, 0) << self.out;
  EXPECT_EQ(step_losses(self.out), expect) << self.out;
  EXPECT_NE(self.out.find("no launcher started this one: " + kLaunch + " --num_gpus 2 --master_port " + port2 + " -- " +
                          POLYTRAIN_BINARY_DIR "/train_bert --config configs/bert_tiny.json"),
            std::string::npos)
      << self.out;
  EXPECT_NE(self.out.find("launch: local, world size 2 on 1 host(s), master 127.0.0.1:" + port2), std::string::npos) << self.out;
  EXPECT_NE(self.out.find("[rank 0] done: 3 steps"), std::string::npos) << self.out;

  json cfg = polytrain::testing::shipped_config("bert_tiny.json");
  cfg["trainer"]["env_type"] = "pytorchDDP";
  cfg["trainer"]["num_gpus"] = 2;
  cfg["trainer"]["master_port"] = polytrain::testing::free_port();
  cfg["train_batch_size"] = 32;
  std::ofstream(t.path / "ddp.json") << cfg.dump(2);
  auto section = run(env_prefix(t) + POLYTRAIN_BINARY_DIR "/train_bert --config '" + (t.path / "ddp.json").string() +
                         "' --eval_interval 1000 --save_interval 0 --log_interval 1 --no_progress_bar --num_threads 1" + exp,
                     POLYTRAIN_SOURCE_DIR);
  ASSERT_EQ(section.code, 0) << section.out;
  EXPECT_EQ(step_losses(section.out), expect) << section.out;
  EXPECT_NE(section.out.find("launch: local, world size 2"), std::string::npos) << section.out;
}

// A rank's failure and a SIGTERM to the program end a self-launched job as they end a launched
// one: the launcher's exit code (137 for a rank killed by SIGKILL, 143 for SIGTERM) and its line.
TEST(SelfLaunch, ExitCodesAndSigtermAreLaunchs) {
  PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                 "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t;
  const std::string exp = " --experiments_dir '" + (t.path / "exp").string() + "'";
  const std::string fault = "POLYTRAIN_FAULT=1:allreduce:2:KILL ";
  auto launched = run(fault + env_prefix(t) + kLaunch + " --num_gpus 2 --master_port " +
                          std::to_string(polytrain::testing::free_port()) + " train_bert" + kSelfLaunchArgs + exp + " --max_steps 5",
                      POLYTRAIN_SOURCE_DIR);
  auto self = run(fault + env_prefix(t) + POLYTRAIN_BINARY_DIR "/train_bert" + kSelfLaunchArgs + exp +
                      " --max_steps 5 --num_gpus 2 --master_port " + std::to_string(polytrain::testing::free_port()),
                  POLYTRAIN_SOURCE_DIR);
  EXPECT_EQ(launched.code, 137) << launched.out;
  EXPECT_EQ(self.code, launched.code) << self.out;
  for (const auto* r : {&launched, &self})
    EXPECT_NE(r->out.find("error: rank 1 (host localhost) (pid "), std::string::npos) << r->out;

  // SIGTERM to the pid the user started: it is the launcher's now.
  OwnProcess job("exec " + env_prefix(t) + POLYTRAIN_BINARY_DIR "/train_bert" + kSelfLaunchArgs + exp +
                     " --max_steps 100000 --num_gpus 2 --master_port " + std::to_string(polytrain::testing::free_port()),
                 POLYTRAIN_SOURCE_DIR, (t.path / "out.txt").string());
  ASSERT_TRUE(wait_until([&] { return job.output().find("[rank 0] step 1/") != std::string::npos || !job.running(); }, 120))
      << job.output();
  ASSERT_TRUE(job.running()) << job.output();
  ASSERT_TRUE(job.signal(SIGTERM)) << job.output();
  EXPECT_EQ(job.wait(), 143) << job.output();
  EXPECT_NE(job.output().find("launch: received Terminated; stopped 2 process(es)"), std::string::npos) << job.output();
}

// Deadlines: a killed rank is seen at once (the launcher reaps it), the others stopped within
// --term_timeout 3; a stopped rank is found by its peer's comm_timeout (8 s), which fails
// with exit code 1, and the stopped one is SIGKILLed after --term_timeout.
INSTANTIATE_TEST_SUITE_P(
    Points, FaultInjection,
    ::testing::Values(Fault{"rendezvous", 1, "KILL", 137, 8}, Fault{"allreduce", 3, "KILL", 137, 8},
                      Fault{"checkpoint", 3, "KILL", 137, 8}, Fault{"eval", 1, "KILL", 137, 8},
                      Fault{"allreduce", 3, "STOP", 1, 20}),
    [](const auto& info) {
      return std::string(info.param.point) + "_" + info.param.signal;
    });

}  // namespace
