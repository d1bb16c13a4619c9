// Stand-in worker for the launcher tests. Prints one line "probe {json}" with the variables a
// launcher sets, the mapped rank (common/dist_env.h) and its arguments, then behaves as asked:
//   --fail_rank R --exit_code C   rank R exits with C (after --fail_after seconds)
//   --fail_while_restart_below K  ...only while TORCHELASTIC_RESTART_COUNT < K
//   --sleep S                     everyone else sleeps S seconds before exiting 0
//   --ignore_term                 ignore SIGTERM (the launcher must escalate to SIGKILL)
//   --grandchild                  fork a child that sleeps in the same process group
//   --detached_grandchild         ...and one that leaves it (setsid), so only the launcher's
//                                 subreaper clean-up can stop it
//   --pid_dir D                   write D/<pid> files for this process (and the grandchild)
//   --lines N                     print N numbered lines
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/common/dist_env.h"

namespace {
void write_pid(const std::string& dir, pid_t pid) {
  if (!dir.empty()) std::ofstream(dir + "/" + std::to_string(pid)) << pid << "\n";
}
}  // namespace

int main(int argc, char** argv) {
  int fail_rank = -1, exit_code = 3, lines = 0, restart_below = -1;
  double sleep_s = 0, fail_after = 0;
  bool ignore_term = false, grandchild = false, detached = false;
  std::string pid_dir;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    auto next = [&] { return i + 1 < args.size() ? args[++i] : std::string("0"); };
    if (a == "--fail_rank") fail_rank = std::stoi(next());
    else if (a == "--exit_code") exit_code = std::stoi(next());
    else if (a == "--fail_after") fail_after = std::stod(next());
    else if (a == "--fail_while_restart_below") restart_below = std::stoi(next());
    else if (a == "--sleep") sleep_s = std::stod(next());
    else if (a == "--ignore_term") ignore_term = true;
    else if (a == "--grandchild") grandchild = true;
    else if (a == "--detached_grandchild") detached = true;
    else if (a == "--pid_dir") pid_dir = next();
    else if (a == "--lines") lines = std::stoi(next());
  }
  nlohmann::json j;
  for (const char* k : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK",
                        "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                        "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "PROBE_FROM_ENV_FILE", "POLYTRAIN_MPI_WORLD",
                        "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_MCA_btl_vader_backing_directory", "OMPI_MCA_orte_tmpdir_base",
                        "OPENBLAS_CORETYPE", "POLYTRAIN_BLAS_KERNEL"}) {
    if (const char* v = std::getenv(k)) j["env"][k] = v;
  }
  const auto d = polytrain::read_dist_env();
  j["dist"] = {{"rank", d.rank}, {"world_size", d.world_size}, {"local_rank", d.local_rank}, {"source", d.source}};
  j["args"] = args;
  j["pid"] = static_cast<int>(getpid());
  std::printf("probe %s\n", j.dump().c_str());
  std::fflush(stdout);
  if (ignore_term) signal(SIGTERM, SIG_IGN);
  write_pid(pid_dir, getpid());
  if (grandchild) {
    const pid_t c = fork();
    if (c == 0) {
      for (;;) pause();
    }
    write_pid(pid_dir, c);
  }
  if (detached) {
    const pid_t c = fork();
    if (c == 0) {
      setsid();
      for (;;) pause();
    }
    write_pid(pid_dir, c);
  }
  for (int i = 0; i < lines; ++i) std::printf("line %d of rank %d\n", i, d.rank);
  std::fflush(stdout);
  const char* rc = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int restart = rc ? std::atoi(rc) : 0;
  if (d.rank == fail_rank && (restart_below < 0 || restart < restart_below)) {
    usleep(static_cast<useconds_t>(fail_after * 1e6));
    std::fprintf(stderr, "probe rank %d failing with %d\n", d.rank, exit_code);
    return exit_code;
  }
  usleep(static_cast<useconds_t>(sleep_s * 1e6));
  return 0;
}
