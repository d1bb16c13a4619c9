// Process supervision: start a group of processes (local workers, or the ssh/pdsh/mpirun/srun
// processes of a multi-node run), relay their output line by line with a rank prefix (and
// to a log file each), and stop the whole group when one fails or the launcher is signalled.
// Protocol: every child leads its own process group and dies with the launcher
// (PR_SET_PDEATHSIG); stopping = SIGTERM to each group still running, SIGKILL to those left
// after the grace period. The launcher is a child subreaper: what a worker leaves behind is
// re-parented to it and stopped the same way when the group ends. Only processes this
// launcher started, or their descendants re-parented to it, are ever signalled, and only
// while they are its unreaped children (so their pids cannot have been given to anyone
// else): by pid or group, never by name. tests/test_launch.cpp checks this under strace.
#pragma once

#include <string>
#include <vector>

namespace polytrain::launcher {

struct ProcSpec {
  std::string label;              ///< "rank 3" / "worker-1": how messages name it
  std::string prefix;             ///< put before each relayed line ("[rank 3] "), may be empty
  /// The worker's global rank, -1 for a runner (ssh, pdsh, mpirun, srun). A worker's `error: `
  /// line that another worker already printed is left off the console (repeated_errors.h).
  int rank = -1;
  std::vector<std::string> argv;  ///< argv[0] looked up on PATH
  std::vector<std::string> env;   ///< the complete environment, KEY=VALUE
  std::string log_path;           ///< also write its output here (created/truncated), or ""
  bool stdin_pipe = false;        ///< give it a pipe as stdin, closed when stopping (ssh)
  /// pdsh: one process for all nodes, which waits for every node. A per-node launcher that
  /// fails prints node_failure_line(); seeing it in this process's output counts as a failure
  /// with that exit code, so the other nodes are stopped at once.
  bool watch_node_failures = false;
};

/// "polytrain-launch: node N failed with exit code C" (printed by per-node launchers).
std::string node_failure_line(int node, int exit_code);

struct SuperviseOptions {
  double term_timeout = 5.0;  ///< seconds between SIGTERM and SIGKILL
  int tail_lines = 20;        ///< lines of a failed process's output shown in the report
  /// If set: once the group has started, this file lists its processes, one line each,
  /// `PID START_TIME LABEL` (START_TIME: field 22 of /proc/PID/stat, so that a reader can
  /// tell the process from a later one that reuses its pid); removed when the group ends.
  std::string pid_file;
  /// Fault tolerance: how many times each lost worker rank (but rank 0) is restarted on its own
  /// to rejoin the group (launch --max_restarts).
  int replacements = 0;
};

/// Field 22 of /proc/PID/stat (start time in clock ticks after boot), or -1.
long long process_start_time(int pid);

struct Outcome {
  int exit_code = 0;       ///< 0, the failed process's code (128+signal if killed), or 128+signal of the launcher
  int failed = -1;         ///< index of the first process that failed, -1 if none
  int launcher_signal = 0; ///< SIGINT/SIGTERM/SIGHUP received by the launcher, 0 if none
};

/// Runs `procs` to completion. The first non-zero exit stops the others and is reported on
/// stderr (which process, its exit code or signal, its last lines but the error lines the
/// console already shows, and which ranks printed the same error line). SIGINT, SIGTERM and
/// SIGHUP to the launcher stop the group too. Once a worker prints a line starting with
/// "fault tolerance: on" (trainer.fault_tolerance), a failed worker no longer stops the group: the
/// others go on without it, a worker named in a "fault tolerance: rank R left" line is killed (it
/// was left out of their group), and the outcome is 0 when any worker exits 0. A lost worker
/// rank other than 0 is then restarted alone, up to `replacements` times, with
/// POLYTRAIN_FT_JOIN=<its restart count>: the replacement joins the running group.
Outcome supervise(const std::vector<ProcSpec>& procs, const SuperviseOptions& opts);

/// The launcher's environment as KEY=VALUE with `overrides` applied.
std::vector<std::string> make_environment(const std::vector<std::pair<std::string, std::string>>& overrides);

/// Arranges for SIGHUP when the parent dies (per-node launchers: the ssh session ending
/// stops the node's workers).
void hangup_when_parent_dies();

}  // namespace polytrain::launcher
