// Test helper: the processes a test signals are its own. A test signals a child it started and
// has not reaped yet (until it is reaped, its pid can belong to no one else), or a process
// listed in a launcher's --pid_file after checking, through a pidfd, that the pid still
// belongs to the process listed. Never a name pattern (pkill -f): that reaches whatever else
// on the machine matches, and a pid kept after its process ended may be someone else's.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/launcher/supervisor.h"

namespace polytrain::testing {

/// `sh -c COMMAND` started in `cwd`, stdout and stderr into `output_path`. Use `exec` in the
/// command when the pid should be the program's own (`exec launch ...`). If it still runs
/// when this object goes, it gets `stop_signal` and is waited for.
class OwnProcess {
 public:
  OwnProcess(const std::string& command, const std::string& cwd, const std::string& output_path,
             int stop_signal = SIGKILL)
      : output_path_(output_path), stop_signal_(stop_signal) {
    const pid_t parent = ::getpid();
    const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
    pid_ = ::fork();
    if (pid_ == 0) {  // only async-signal-safe calls until exec: the test may have threads
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a crashed test leaves nothing running
      if (::getppid() != parent) ::_exit(127);
      const int out = ::open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (out < 0 || ::chdir(cwd.c_str()) != 0) ::_exit(127);
      ::dup2(out, 1);
      ::dup2(out, 2);
      ::execv("/bin/sh", const_cast<char* const*>(argv));
      ::_exit(127);
    }
  }
  OwnProcess(const OwnProcess&) = delete;
  OwnProcess& operator=(const OwnProcess&) = delete;
  ~OwnProcess() {
    if (pid_ > 0 && !reaped_) {  // still ours: nothing else can hold this pid
      ::kill(pid_, stop_signal_);
      wait();
    }
  }

  pid_t pid() const { return pid_; }

  /// True while it runs; reaps it (and keeps its status) once it has exited.
  bool running() {
    if (pid_ <= 0 || reaped_) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return true;
    reaped_ = true, status_ = st;
    return false;
  }

  /// Sends `sig` if the process has not been reaped; false otherwise (the pid is not ours).
  bool signal(int sig) { return pid_ > 0 && !reaped_ && ::kill(pid_, sig) == 0; }

  /// Waits for it; its exit code, 128 + the signal that killed it, or -1.
  int wait() {
    if (pid_ <= 0) return -1;  // fork failed
    if (!reaped_) {
      int st = 0;
      while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
      }
      reaped_ = true, status_ = st;
    }
    if (WIFEXITED(status_)) return WEXITSTATUS(status_);
    return WIFSIGNALED(status_) ? 128 + WTERMSIG(status_) : -1;
  }

  /// What it has written so far.
  std::string output() const {
    std::ifstream f(output_path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string output_path_;
  int stop_signal_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

/// Polls `done` every `poll_ms` for up to `seconds`; its last answer.
inline bool wait_until(const std::function<bool()>& done, double seconds, int poll_ms = 50) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
  return true;
}

/// One line of a launcher's --pid_file: `PID START_TIME LABEL`.
struct ListedProcess {
  int pid = -1;
  long long start_time = -1;
  std::string label;  ///< "rank 1 (host localhost)", "openmpi", "host nodeA (ssh)"
};

/// The processes listed in `path` (empty while the file does not exist).
inline std::vector<ListedProcess> read_pid_file(const std::string& path) {
  std::vector<ListedProcess> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    ListedProcess p;
    if (!(in >> p.pid >> p.start_time)) continue;
    std::getline(in >> std::ws, p.label);
    out.push_back(p);
  }
  return out;
}

/// The process labelled `label_prefix...` in `path`, or {} (pid -1).
inline ListedProcess find_listed(const std::string& path, const std::string& label_prefix) {
  for (const auto& p : read_pid_file(path))
    if (p.label.rfind(label_prefix, 0) == 0) return p;
  return {};
}

/// Sends `sig` to `p` only if its pid still belongs to it: a pidfd pins whatever holds the pid
/// now, and the start time read after that must be the one listed. A process that has ended
/// (its pid free, or reused by another process) is not signalled; returns whether it was.
inline bool signal_listed(const ListedProcess& p, int sig) {
  if (p.pid <= 0) return false;
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, p.pid, 0));
  if (fd < 0) return false;
  const bool same = polytrain::launcher::process_start_time(p.pid) == p.start_time;
  const bool sent = same && ::syscall(SYS_pidfd_send_signal, fd, sig, nullptr, 0) == 0;
  ::close(fd);
  return sent;
}

}  // namespace polytrain::testing
