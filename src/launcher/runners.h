// Runners build command lines only: the local worker argv, the per-node launcher command a
// multi-node run executes on each host, and the pdsh / ssh / mpirun / srun invocations.
// Nothing here starts a process (supervisor.h does); everything is testable as strings.
#pragma once

#include <string>
#include <vector>

#include "polytrain/launcher/env_file.h"
#include "polytrain/launcher/plan.h"

namespace polytrain::launcher {

using Argv = std::vector<std::string>;

/// Everything `launch` was asked to do (CLI flags; see launch_main.cpp).
struct LaunchOptions {
  std::string hostfile = "/job/hostfile";  ///< DeepSpeed's default; absent = this machine
  bool hostfile_given = false;             ///< given explicitly: then it must exist
  std::string include, exclude;
  int num_nodes = -1, num_gpus = -1;
  std::string master_addr;
  int master_port = 29500;
  std::string launcher;       ///< local, pdsh, ssh, openmpi, slurm; empty = choose
  std::string launcher_args;  ///< split on spaces, passed to pdsh/ssh/mpirun/srun
  int node_rank = -1;
  bool no_ssh = false;
  bool no_mpi_world = false;   ///< do not serve PMIx: the local ranks form no MPI job
  int max_restarts = 0;
  std::string log_dir;
  std::string pid_file;        ///< list the started processes' pids here while they run
  bool no_local_rank = false;
  bool dry_run = false;
  double term_timeout = 5.0;   ///< seconds between SIGTERM and SIGKILL when stopping workers
  std::string slot_type = "auto";  ///< gpu, cpu, auto (gpu when this machine has NVIDIA devices)
  // internal: a per-node launcher's own node (ssh: explicit; pdsh: from the slot layout)
  std::string node_host, node_slots, slot_layout;
  int rank_offset = -1, world_size = -1, world_nodes = -1;
  Argv program;                ///< PROGRAM [ARGS...]
};

/// PROGRAM ARGS [--local_rank=N].
Argv worker_argv(const LaunchOptions& o, int local_rank);

/// What runs on node `node_index` of a multi-node launch through ssh: this launcher again, in
/// per-node mode, told only its own node (--node_host, --node_rank, --node_slots,
/// --rank_offset) and the world's size (--world_size, --num_nodes): every host's command has
/// the same length whatever the number of hosts, and the hostfile need not exist there.
Argv node_launcher_argv(const LaunchOptions& o, const WorldPlan& plan, int node_index, const std::string& self_exe);

/// The one command pdsh runs on every host: the world's slot layout run-length encoded
/// (--slot_layout 10000x0-7) and --node_rank %n, which pdsh replaces by the host's index.
Argv pdsh_node_launcher_argv(const LaunchOptions& o, const WorldPlan& plan, const std::string& self_exe);

/// "cd CWD && exec env K=V ... ARGV" with every word shell-quoted.
std::string remote_shell_command(const std::string& cwd, const EnvList& exports, const Argv& argv);

std::string shell_quote(const std::string& word);
std::string join_command(const Argv& argv);
/// Splits --launcher_args on whitespace (no shell evaluation).
Argv split_words(const std::string& s);

/// pdsh -S (a remote failure becomes pdsh's exit code) -f 1024 -w h1,h2 [args] CMD with %n.
Argv pdsh_argv(const LaunchOptions& o, const WorldPlan& plan, const std::string& remote_command);
/// ssh [args] HOST CMD, one connection per host.
Argv ssh_argv(const LaunchOptions& o, const std::string& host, const std::string& remote_command);
/// mpirun -n W -hostfile F [--allow-run-as-root] -x K=V... [args] PROGRAM ARGS. Ranks come
/// from OMPI_COMM_WORLD_* in the workers; every host's slots must be 0..k-1.
Argv mpirun_argv(const LaunchOptions& o, const WorldPlan& plan, const EnvList& exports,
                 const std::string& generated_hostfile);
/// Text of the hostfile given to mpirun ("HOST slots=N").
std::string mpirun_hostfile(const WorldPlan& plan);
/// srun -n W --nodelist h1,h2 --ntasks-per-node N --export=ALL,K=V [args] PROGRAM ARGS.
/// Slurm places the same count on every node: uneven or non-0-based slots are an error.
Argv srun_argv(const LaunchOptions& o, const WorldPlan& plan, const EnvList& exports);

/// Full path of `name` on PATH, or "" when it is not there.
std::string find_in_path(const std::string& name);

/// Variables of the launcher's own environment that travel to remote workers (as DeepSpeed's
/// runner exports NCCL_*, PYTHON* ...): NCCL_, GLOO_, OMP_, UCX_, POLYTRAIN_ prefixes, the
/// sanitizers' ASAN_, LSAN_, UBSAN_, TSAN_ options, PATH, LD_LIBRARY_PATH; then the
/// .deepspeed_env entries (which win).
EnvList remote_exports(const EnvList& env_file_entries);

}  // namespace polytrain::launcher
