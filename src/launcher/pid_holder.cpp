#include "polytrain/launcher/pid_holder.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace polytrain::launcher {
namespace {

// Sent to a rank's whole group by mpirun (kill, forwarding) or by a terminal: the holder and
// the keeper ignore them, PROGRAM gets them as usual.
const int kGroupSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGTSTP, SIGTTIN, SIGTTOU, SIGPIPE};

void ignore_group_signals() {
  for (int s : kGroupSignals) signal(s, SIG_IGN);
}

// The keeper: no file descriptors but a pidfd of mpirun/orted, whose end it waits for.
[[noreturn]] void keep_group(int runner_fd) {
  ignore_group_signals();
  for (int fd = 0; fd < 1024; ++fd)
    if (fd != runner_fd) close(fd);
  if (runner_fd < 0) _exit(0);  // no pidfd (kernel < 5.3): nothing to wait on
  pollfd p{runner_fd, POLLIN, 0};
  while (poll(&p, 1, -1) < 0 && errno == EINTR) {
  }
  _exit(0);
}

}  // namespace

void run_holding_pid(const std::vector<std::string>& args) {
  if (getpgid(0) != getpid()) setpgid(0, 0);  // Open MPI already makes each rank lead a group
  const pid_t runner = getppid();
  int runner_fd = static_cast<int>(syscall(SYS_pidfd_open, runner, 0));
  if (runner_fd >= 0 && getppid() != runner) close(runner_fd), runner_fd = -1;  // mpirun already gone
  // Until the holder ignores them, a group signal is held, not lost.
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  if (fork() == 0) keep_group(runner_fd);
  if (runner_fd >= 0) close(runner_fd);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    sigprocmask(SIG_SETMASK, &old, nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "launch --hold_pid: cannot run '%s': %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  ignore_group_signals();
  sigprocmask(SIG_SETMASK, &old, nullptr);
  int st = 0;
  while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(st)) {  // die the same way, so that mpirun reports PROGRAM's signal
    const int sig = WTERMSIG(st);
    signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    sigprocmask(SIG_UNBLOCK, &one, nullptr);
    raise(sig);
  }
  _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 1);
}

}  // namespace polytrain::launcher
