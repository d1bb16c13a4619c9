#include "polytrain/launcher/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <dirent.h>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "polytrain/common/error.h"
#include "polytrain/launcher/repeated_errors.h"

extern char** environ;

namespace polytrain::launcher {
namespace {

using ::polytrain::detail::cat;
using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};
pid_t g_launcher_pid = -1;  // a handler running in a forked child must not speak for us

void on_signal(int signo) {
  if (getpid() != g_launcher_pid) return;
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(signo);
  if (write(g_signal_pipe[1], &b, 1) < 0) {
  }  // full pipe: a wake-up is already pending
  errno = saved;
}

const int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

struct SignalScope {  // the handlers live exactly as long as one supervise() call
  struct sigaction old[4];
  SignalScope() {
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw InternalError(cat("pipe2: ", std::strerror(errno)));
    g_launcher_pid = getpid();
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_NOCLDSTOP;
    for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &sa, &old[i]);
  }
  ~SignalScope() {
    for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &old[i], nullptr);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
};

struct Stream {
  int fd = -1;
  FILE* out = nullptr;  // stdout or stderr
  std::string pending;  // a partial line
};

struct Proc {
  const ProcSpec* spec = nullptr;
  pid_t pid = -1;
  bool reaped = false;
  int status = 0;
  int stdin_fd = -1;
  Stream streams[2];
  FILE* log = nullptr;
  std::deque<std::string> tail;
  int reported_code = -1;  // from a node failure line (watch_node_failures)
  // Fault tolerance: in the others' group (a replacement is not until a "joined" line names it).
  bool member = true;
};

// Processes whose parent is this launcher other than `known`: descendants of workers that
// were re-parented here (we are their subreaper).
std::vector<pid_t> adopted_children(const std::vector<pid_t>& known) {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  // A /proc of another pid namespace (a container's unmounted host /proc) names other
  // processes by the numbers our kill() would use: then we cannot tell which are ours.
  char link[32] = {};
  if (readlink("/proc/self", link, sizeof(link) - 1) <= 0 || std::atoi(link) != self) return out;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/stat");
    std::string stat;
    std::getline(f, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == self && std::find(known.begin(), known.end(), pid) == known.end()) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(d);
  return out;
}

// `PID START_TIME LABEL` per process, written to a temporary name and renamed, so a reader
// never sees half a file. The processes are our children and not reaped yet: their pids
// and start times are theirs.
void write_pid_file(const std::string& path, const std::vector<Proc>& procs) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  bool ok = f != nullptr;
  for (const auto& p : procs) {
    if (ok && p.pid > 0) ok = std::fprintf(f, "%d %lld %s\n", static_cast<int>(p.pid), process_start_time(p.pid), p.spec->label.c_str()) > 0;
  }
  if (f && std::fclose(f) != 0) ok = false;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "launch: warning: cannot write --pid_file '%s': %s\n", path.c_str(), std::strerror(errno));
    unlink(tmp.c_str());
  }
}

// The exit code announced by a per-node launcher's failure line, or -1.
int node_failure_code(const std::string& line) {
  static const std::regex re("polytrain-launch: node [0-9]+ failed with exit code ([0-9]+)");
  std::smatch m;
  return std::regex_search(line, m, re) ? std::stoi(m[1]) : -1;
}

// Lines of the training program's fault tolerance (trainer.fault_tolerance) the launcher acts on.
const char kFaultToleranceOn[] = "fault tolerance: on";
const std::regex& ranks_left_line() {
  static const std::regex re("^fault tolerance: ranks? ([0-9]+(, [0-9]+)*) left");
  return re;
}
const std::regex& ranks_joined_line() {
  static const std::regex re("^fault tolerance: ranks? ([0-9]+(, [0-9]+)*) joined");
  return re;
}

void emit_line(Proc& p, Stream& s, const std::string& line, int tail_lines, RepeatedErrors& errors,
               std::vector<std::string>& fault_tolerance_lines) {
  if (p.spec->rank >= 0 && line.rfind("fault tolerance: ", 0) == 0) fault_tolerance_lines.push_back(line);
  if (p.spec->rank < 0 || errors.show(line, p.spec->rank)) {
    const std::string text = p.spec->prefix + line + "\n";
    std::fwrite(text.data(), 1, text.size(), s.out);
    std::fflush(s.out);
  }
  if (p.log) {
    std::fwrite(line.data(), 1, line.size(), p.log);
    std::fputc('\n', p.log);
    std::fflush(p.log);
  }
  p.tail.push_back(line);
  while (static_cast<int>(p.tail.size()) > tail_lines) p.tail.pop_front();
  if (p.spec->watch_node_failures && p.reported_code < 0) p.reported_code = node_failure_code(line);
}

// Reads what is available; returns false at EOF.
bool pump(Proc& p, Stream& s, int tail_lines, RepeatedErrors& errors, std::vector<std::string>& ft_lines) {
  char buf[65536];
  const ssize_t n = read(s.fd, buf, sizeof(buf));
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  if (n <= 0) {
    if (!s.pending.empty()) emit_line(p, s, s.pending, tail_lines, errors, ft_lines);
    s.pending.clear();
    close(s.fd);
    s.fd = -1;
    return false;
  }
  s.pending.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t end; (end = s.pending.find_first_of("\r\n", start)) != std::string::npos; start = end + 1) {
    std::string piece = s.pending.substr(start, end - start);
    if (s.pending[end] == '\r') {
      // A progress bar redrawing itself: relay it now, keep it out of the log and the tail.
      const std::string text = p.spec->prefix + piece + "\r";
      std::fwrite(text.data(), 1, text.size(), s.out);
      std::fflush(s.out);
      continue;
    }
    emit_line(p, s, piece, tail_lines, errors, ft_lines);
  }
  s.pending.erase(0, start);
  return true;
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

void start(Proc& p) {
  int out[2], err[2], in[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || (p.spec->stdin_pipe && pipe2(in, O_CLOEXEC) != 0)) {
    throw InternalError(cat("pipe2: ", std::strerror(errno)));
  }
  auto argv = c_strings(p.spec->argv);
  auto envp = c_strings(p.spec->env);
  const pid_t parent = getpid();
  // Signals stay blocked from before fork() until the child has its default handlers back.
  // Otherwise a SIGTERM to the child's new group sent at once (another rank failed right
  // away) runs our handler in the child, which writes it into the signal pipe it shares with
  // us until exec: the launcher then reads it as a signal to itself ("launch: received
  // Terminated"), and the child, which caught it, lives on.
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    sigprocmask(SIG_SETMASK, &old, nullptr);
    throw InternalError(cat("fork: ", std::strerror(err)));
  }
  if (pid == 0) {
    // Child: own process group (so the whole worker tree can be signalled), killed with the
    // launcher, default signal dispositions, then whatever arrived meanwhile is delivered
    // (and acted on by default), output into the pipes.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(137);  // the launcher died before prctl took effect
    for (int s : kSignals) signal(s, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int devnull = open("/dev/null", O_RDONLY);
    dup2(p.spec->stdin_pipe ? in[0] : devnull, 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    execvpe(argv[0], argv.data(), envp.data());
    dprintf(2, "cannot run '%s': %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  sigprocmask(SIG_SETMASK, &old, nullptr);
  setpgid(pid, pid);  // also from the parent: no window where the child is in our group
  p.pid = pid;
  close(out[1]);
  close(err[1]);
  if (in[0] >= 0) close(in[0]);
  p.stdin_fd = in[1];
  p.streams[0] = {out[0], stdout, {}};
  p.streams[1] = {err[0], stderr, {}};
  for (auto& s : p.streams) fcntl(s.fd, F_SETFL, fcntl(s.fd, F_GETFL) | O_NONBLOCK);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return cat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return cat("exited with code ", exit_code_of(status));
}

// One supervise() call's state: the processes, how far stopping them has got, and the outcome so far.
struct Group {
  const SuperviseOptions& opts;
  std::vector<Proc> procs;
  Outcome result;
  RepeatedErrors errors;  // the ranks' error lines, each shown once on the console
  bool stopping = false, killed = false;
  // Fault tolerance, once a rank said it is on: a failed worker is a lost rank the others go
  // on without (the first one kept for the report should they all fail).
  bool fault_tolerant = false;
  int first_lost = -1;
  std::vector<std::string> ft_lines;  // fault tolerance lines not acted on yet
  // Replacements: per rank, how many times it was restarted; their specs (stable addresses);
  // the ranks to restart once reap() is done with the process list.
  std::map<int, int> restarts;
  std::deque<ProcSpec> replacement_specs;
  std::vector<size_t> to_replace;
  Clock::time_point kill_at{}, drain_until{};

  Group(const std::vector<ProcSpec>& specs, const SuperviseOptions& o);
  void begin_stop();
  void kill_all();
  void reap();
  void stop_adopted();
  void start_all();
  void relay_until_done();
  void wait_and_relay(Clock::time_point now, bool all_reaped);
  void on_launcher_signals();
  void release();
  Outcome report();
  void report_failure(const Proc& f) const;
  void on_failure(size_t i);
  bool any_succeeded() const {
    for (const auto& p : procs)
      if (p.spec->rank >= 0 && p.reaped && exit_code_of(p.status) == 0) return true;
    return false;
  }
  void on_fault_tolerance_lines();
  void replace_lost();
};

// One Proc per spec, its log file (if any) opened.
Group::Group(const std::vector<ProcSpec>& specs, const SuperviseOptions& o) : opts(o), procs(specs.size()) {
  for (size_t i = 0; i < specs.size(); ++i) {
    procs[i].spec = &specs[i];
    if (!specs[i].log_path.empty()) {
      procs[i].log = std::fopen(specs[i].log_path.c_str(), "w");
      if (!procs[i].log) throw InputError(cat("--log_dir: cannot write '", specs[i].log_path, "': ", std::strerror(errno)));
    }
  }
}

// SIGTERM to every group still running (once), stdin pipes closed; SIGKILL is due at kill_at.
void Group::begin_stop() {
  if (stopping) return;
  stopping = true;
  kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts.term_timeout * 1000));
  for (auto& p : procs) {
    if (p.stdin_fd >= 0) close(p.stdin_fd), p.stdin_fd = -1;
    if (p.pid > 0 && !p.reaped) kill(-p.pid, SIGTERM);
  }
}

// SIGKILL to every group still running.
void Group::kill_all() {
  killed = true;
  for (auto& p : procs)
    if (p.pid > 0 && !p.reaped) kill(-p.pid, SIGKILL);
}

// Reaps the processes that exited; the first failure (or reported node failure) stops the group.
void Group::reap() {
  for (size_t i = 0; i < procs.size(); ++i) {
    auto& p = procs[i];
    if (p.reported_code > 0 && result.failed < 0 && !stopping) {
      result.failed = static_cast<int>(i);
      begin_stop();
    }
    if (p.pid <= 0 || p.reaped) continue;
    int st = 0;
    if (waitpid(p.pid, &st, WNOHANG) != p.pid) continue;
    p.reaped = true;
    p.status = st;
    if (exit_code_of(st) != 0 && result.failed < 0 && !stopping) on_failure(i);
  }
  replace_lost();
}

// A failed process stops the group, unless fault tolerance is on: then a failed worker is a lost
// rank, and the others go on without it or stop by themselves.
void Group::on_failure(size_t i) {
  const Proc& p = procs[i];
  if (fault_tolerant && p.spec->rank >= 0) {
    if (first_lost < 0) first_lost = static_cast<int>(i);
    // A lost rank other than 0 (whose process hosts the rendezvous store) is restarted while it
    // has restarts left and no rank has finished: the replacement rejoins at a step boundary.
    const int done = restarts[p.spec->rank];
    const bool replace = p.spec->rank > 0 && done < opts.replacements && !any_succeeded();
    std::fprintf(stderr, "launch: %s (pid %d) %s; fault tolerance: %s\n", p.spec->label.c_str(),
                 static_cast<int>(p.pid), describe(p.status).c_str(),
                 replace ? cat("restarting it (restart ", done + 1, " of ", opts.replacements,
                               ") to rejoin the others at a step boundary").c_str()
                         : "the other ranks go on or stop by themselves");
    std::fflush(stderr);
    if (replace) to_replace.push_back(i);
    return;
  }
  result.failed = static_cast<int>(i);
  begin_stop();
}

// Starts a replacement for each lost rank in to_replace: the same command and rank, with
// POLYTRAIN_FT_JOIN set to its restart count (the trainer then joins the running group instead
// of starting one, and POLYTRAIN_FAULT's faults stay off in it). Its log file is appended to.
void Group::replace_lost() {
  for (size_t i : to_replace) {
    const ProcSpec& old = *procs[i].spec;
    const int n = ++restarts[old.rank];
    ProcSpec spec = old;
    spec.env.erase(std::remove_if(spec.env.begin(), spec.env.end(),
                                  [](const std::string& kv) { return kv.rfind("POLYTRAIN_FT_JOIN=", 0) == 0; }),
                   spec.env.end());
    spec.env.push_back(cat("POLYTRAIN_FT_JOIN=", n));
    replacement_specs.push_back(std::move(spec));
    Proc p;
    p.spec = &replacement_specs.back();
    p.member = false;
    if (!p.spec->log_path.empty()) {
      p.log = std::fopen(p.spec->log_path.c_str(), "a");
      if (!p.log) throw InputError(cat("--log_dir: cannot write '", p.spec->log_path, "': ", std::strerror(errno)));
    }
    procs.push_back(std::move(p));
    start(procs.back());
  }
  if (!to_replace.empty() && !opts.pid_file.empty()) write_pid_file(opts.pid_file, procs);
  to_replace.clear();
}

// "fault tolerance: on" switches the group to fault tolerance; "fault tolerance: rank R left"
// means the survivors regrouped without R: a rank that is only silent (stopped, hung) is killed,
// since it must not come back into a group that moved on.
void Group::on_fault_tolerance_lines() {
  for (const auto& line : ft_lines) {
    if (line.rfind(kFaultToleranceOn, 0) == 0) fault_tolerant = true;
    std::smatch m;
    if (!fault_tolerant) continue;
    if (std::regex_search(line, m, ranks_joined_line())) {  // the replacements are members now
      std::stringstream ranks(m[1].str());
      for (std::string r; std::getline(ranks, r, ',');)
        for (auto& p : procs)
          if (p.spec->rank == std::stoi(r) && p.pid > 0 && !p.reaped) p.member = true;
      continue;
    }
    if (!std::regex_search(line, m, ranks_left_line())) continue;
    std::stringstream ranks(m[1].str());
    for (std::string r; std::getline(ranks, r, ',');) {
      const int rank = std::stoi(r);
      // Not a replacement still waiting to join: the rank that left is the one in the group.
      for (auto& p : procs)
        if (p.spec->rank == rank && p.member && p.pid > 0 && !p.reaped) kill(-p.pid, SIGKILL);
    }
  }
  ft_lines.clear();
}

// What workers left behind (re-parented to us): SIGTERM, SIGKILL after the grace period,
// then reaped, so nothing outlives the launcher.
void Group::stop_adopted() {
  std::vector<pid_t> known;
  for (const auto& p : procs) known.push_back(p.pid);
  auto left = adopted_children(known);
  if (left.empty()) return;
  for (pid_t pid : left) kill(pid, SIGTERM);
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts.term_timeout * 1000));
  while (!left.empty() && Clock::now() < deadline) {
    usleep(20000);
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    left = adopted_children(known);
  }
  for (pid_t pid : left) kill(pid, SIGKILL);
  for (pid_t pid : left) waitpid(pid, nullptr, 0);
}

// Starts every process, then lists them in the pid file (if asked for).
void Group::start_all() {
  for (size_t i = 0; i < procs.size() && !stopping; ++i) {
    start(procs[i]);
  }
  if (!opts.pid_file.empty()) write_pid_file(opts.pid_file, procs);
}

// The supervision loop: reaps, stops the group when due, relays output, until all exited and their output is drained.
void Group::relay_until_done() {
  bool all_reaped = false;
  while (true) {
    reap();
    all_reaped = true;
    bool open_streams = false;
    for (auto& p : procs) {
      all_reaped = all_reaped && (p.pid <= 0 || p.reaped);
      for (auto& s : p.streams) open_streams = open_streams || s.fd >= 0;
    }
    const auto now = Clock::now();
    if (all_reaped && drain_until == Clock::time_point{}) {
      stop_adopted();
      drain_until = Clock::now() + std::chrono::seconds(1);
    }
    // Output still open after every process exited belongs to a stray grandchild: stop
    // relaying it after a second rather than wait on it.
    if (all_reaped && (!open_streams || now >= drain_until)) break;
    if (stopping && !killed && now >= kill_at) kill_all();
    wait_and_relay(now, all_reaped);
  }
}

// Polls the signal pipe and the open output streams until the next deadline, then handles what arrived.
void Group::wait_and_relay(Clock::time_point now, bool all_reaped) {
  std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
  std::vector<std::pair<Proc*, Stream*>> owners{{nullptr, nullptr}};
  for (auto& p : procs) {
    for (auto& s : p.streams) {
      if (s.fd >= 0) fds.push_back({s.fd, POLLIN, 0}), owners.emplace_back(&p, &s);
    }
  }
  int timeout_ms = 1000;
  auto until = [&](Clock::time_point t) {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1));
  };
  if (stopping && !killed) timeout_ms = std::min(timeout_ms, until(kill_at));
  if (all_reaped) timeout_ms = std::min(timeout_ms, until(drain_until));
  if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
    throw InternalError(cat("poll: ", std::strerror(errno)));
  }
  if (fds[0].revents & POLLIN) on_launcher_signals();
  for (size_t k = 1; k < fds.size(); ++k) {
    if (fds[k].revents & (POLLIN | POLLHUP | POLLERR))
      pump(*owners[k].first, *owners[k].second, opts.tail_lines, errors, ft_lines);
  }
  on_fault_tolerance_lines();
}

// The signals the launcher received (from the signal pipe): the first stops the group, a second kills it.
void Group::on_launcher_signals() {
  unsigned char sig[64];
  const ssize_t n = read(g_signal_pipe[0], sig, sizeof(sig));
  for (ssize_t k = 0; k < n; ++k) {
    if (sig[k] == SIGCHLD) continue;  // reaped at the top of the loop
    if (result.launcher_signal != 0 && stopping && !killed) {
      kill_all();  // a second Ctrl-C: do not wait for the grace period
    }
    if (result.launcher_signal == 0) result.launcher_signal = sig[k];
    begin_stop();
  }
}

// Closes the pipes and logs, reaps what is left and removes the pid file.
void Group::release() {
  for (auto& p : procs) {
    for (auto& s : p.streams)
      if (s.fd >= 0) close(s.fd);
    if (p.stdin_fd >= 0) close(p.stdin_fd);
    if (p.log) std::fclose(p.log);
  }
  while (waitpid(-1, nullptr, WNOHANG) > 0) {
  }
  if (!opts.pid_file.empty()) unlink(opts.pid_file.c_str());  // its pids are free for reuse now
}

// Sets the exit code and reports on stderr why the group stopped (a signal to the launcher, or a failure).
Outcome Group::report() {
  for (const auto& note : errors.notes()) std::fprintf(stderr, "%s\n", note.c_str());
  // Fault tolerance: the job succeeded when a rank finished; else the first loss is its failure.
  if (result.launcher_signal == 0 && result.failed < 0 && first_lost >= 0 && !any_succeeded()) result.failed = first_lost;
  if (result.launcher_signal != 0) {
    result.exit_code = 128 + result.launcher_signal;
    std::fprintf(stderr, "launch: received %s; stopped %zu process(es)\n", strsignal(result.launcher_signal),
                 procs.size());
  } else if (result.failed >= 0) {
    const Proc& f = procs[result.failed];
    result.exit_code = f.reported_code > 0 ? f.reported_code : exit_code_of(f.status);
    if (f.reported_code > 0) {
      std::fprintf(stderr, "error: %s reported a failed node (exit code %d, see above); stopped the job\n",
                   f.spec->label.c_str(), f.reported_code);
      std::fflush(stderr);
      return result;
    }
    report_failure(f);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  return result;
}

// Which process failed and how, and its last lines but the error lines shown above.
void Group::report_failure(const Proc& f) const {
  std::vector<std::string> tail;
  for (const auto& line : f.tail)
    if (f.spec->rank < 0 || !errors.shown(line)) tail.push_back(line);
  const bool error_above = tail.size() < f.tail.size();
  int others = 0;
  for (const auto& p : procs) others += &p != &f && p.pid > 0;
  std::fprintf(stderr, "error: %s (pid %d) %s%s%s%s\n", f.spec->label.c_str(), static_cast<int>(f.pid),
               describe(f.status).c_str(), error_above ? " with the error above" : "",
               others ? cat("; stopped the other ", others, " process(es)").c_str() : "",
               tail.empty() ? "" : cat("; its last ", tail.size(), error_above ? " other" : "", " line(s):").c_str());
  for (const auto& line : tail) std::fprintf(stderr, "  | %s\n", line.c_str());
  if (!f.spec->log_path.empty()) std::fprintf(stderr, "  full output: %s\n", f.spec->log_path.c_str());
}

}  // namespace

std::vector<std::string> make_environment(const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::map<std::string, std::string> env;
  std::vector<std::string> order;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq);
    if (!env.count(k)) order.push_back(k);
    env[k] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : overrides) {
    if (!env.count(k)) order.push_back(k);
    env[k] = v;
  }
  std::vector<std::string> out;
  for (const auto& k : order) out.push_back(k + "=" + env[k]);
  return out;
}

void hangup_when_parent_dies() { prctl(PR_SET_PDEATHSIG, SIGHUP); }

long long process_start_time(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {  // fields 3.. follow the ")"
    if (i == 22) return std::stoll(field);
  }
  return -1;
}

std::string node_failure_line(int node, int exit_code) {
  return cat("polytrain-launch: node ", node, " failed with exit code ", exit_code);
}

Outcome supervise(const std::vector<ProcSpec>& specs, const SuperviseOptions& opts) {
  SignalScope signals;
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  Group group(specs, opts);
  group.start_all();
  group.relay_until_done();
  group.release();
  return group.report();
}

}  // namespace polytrain::launcher
