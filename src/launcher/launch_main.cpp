// `launch [options] PROGRAM [ARGS...]`: DeepSpeed-runner hostfile/filter semantics, the
// torchrun worker environment, local spawning with supervision, multi-node through pdsh,
// ssh, Open MPI or Slurm, and --max_restarts. Flags are documented in docs/launcher.md.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "polytrain/common/cli_suggest.h"
#include "polytrain/common/error.h"
#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/cpu_budget.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/launcher/env_file.h"
#include "polytrain/launcher/hostfile.h"
#include "polytrain/launcher/mpi_world.h"
#include "polytrain/launcher/pid_holder.h"
#include "polytrain/launcher/plan.h"
#include "polytrain/launcher/port_check.h"
#include "polytrain/launcher/runners.h"
#include "polytrain/launcher/supervisor.h"
#include "polytrain/launcher/torchrun_names.h"

using namespace polytrain;
using namespace polytrain::launcher;
using ::polytrain::detail::cat;

namespace {

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "launch";
}

std::string current_dir() {
  char buf[4096];
  return getcwd(buf, sizeof(buf)) ? std::string(buf) : ".";
}

bool file_exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0;
}

int local_gpu_count() {
  int n = 0;
  while (file_exists("/dev/nvidia" + std::to_string(n))) ++n;
  return n;
}

// PROGRAM as given when it names a path or is on PATH; else the file of that name next to
// this launcher (build/ and bin/ hold both), so `build/launch train_bert` works.
std::string resolve_program(const std::string& program, bool must_exist) {
  if (program.find('/') != std::string::npos || !find_in_path(program).empty()) return program;
  const std::string exe = self_exe();
  const std::string sibling = exe.substr(0, exe.rfind('/') + 1) + program;
  if (access(sibling.c_str(), X_OK) == 0) return sibling;
  if (must_exist) throw InputError(cat("program '", program, "' is not on PATH nor next to ", exe));
  return program;
}

void make_dirs(const std::string& dir) {
  std::string path;
  std::istringstream in(dir);
  for (std::string part; std::getline(in, part, '/');) {
    path += part + "/";
    if (!part.empty()) mkdir(path.c_str(), 0755);
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw InputError(cat("--log_dir: cannot create '", dir, "'"));
}

// What mpirun runs for each rank: PROGRAM under `launch --hold_pid` (pid_holder.h), so that
// mpirun's signals to a rank it has already reaped cannot reach a process that is not ours.
LaunchOptions with_pid_holder(LaunchOptions o) {
  Argv held{self_exe(), "--hold_pid", "--"};
  held.insert(held.end(), o.program.begin(), o.program.end());
  o.program = held;
  return o;
}

struct Job {
  std::string launcher;             // local (this node's ranks), pdsh, ssh, openmpi, slurm
  int node = 0;                     // for local: which node of the plan runs here
  std::vector<ProcSpec> procs;      // what the supervisor starts
  nlohmann::json hosts_commands;    // per host: the commands that run there (dry run)
  Argv runner;                      // pdsh / mpirun / srun argv, empty otherwise
  std::string mpi_hostfile_text;
};

// The processes of this node's ranks, started directly.
void local_procs(const LaunchOptions& o, const WorldPlan& plan, int node, const EnvList& exports, int restart,
                 const LocalMpiWorld* world, Job& job) {
  const auto& n = plan.nodes.at(node - plan.first_node);
  // The CPUs this launcher may use (affinity mask, cgroup quota), shared fairly among its workers.
  // torchrun sets 1; a fair share of the CPUs wastes less of a CPU host.
  const bool set_threads = !std::getenv("OMP_NUM_THREADS") && n.ranks.size() > 1;
  const std::string share =
      set_threads ? std::to_string(std::max<size_t>(1, static_cast<size_t>(available_cpus()) / n.ranks.size())) : "";
  // OpenBLAS's kernel for this host's CPU, when its own pick fell back to an older one (the
  // workers would otherwise each re-execute themselves to get it; src/common/blas_kernel.h).
  static const BlasKernelChoice blas =
      choose_openblas_core(host_cpu_features(), openblas_core_of_libblas(), user_openblas_coretype());
  for (size_t i = 0; i < n.ranks.size(); ++i) {
    EnvList env = exports;
    if (set_threads) set_env(env, "OMP_NUM_THREADS", share);
    if (!blas.coretype.empty()) {
      set_env(env, "OPENBLAS_CORETYPE", blas.coretype);
      set_env(env, kBlasChoiceEnv, blas_kernel_env_value(blas));
    }
    for (const auto& [k, v] : worker_env(plan, node, static_cast<int>(i), restart)) set_env(env, k, v);
    if (world)
      for (const auto& [k, v] : world->env(static_cast<int>(i))) set_env(env, k, v);
    if (isatty(STDERR_FILENO)) set_env(env, "POLYTRAIN_TTY", "1");  // progress bars may redraw
    ProcSpec p;
    p.label = cat("rank ", n.ranks[i], " (host ", n.host, ")");
    p.prefix = cat("[rank ", n.ranks[i], "] ");
    p.rank = n.ranks[i];
    p.argv = worker_argv(o, static_cast<int>(i));
    p.env = make_environment(env);
    if (!o.log_dir.empty()) p.log_path = cat(o.log_dir, "/rank_", n.ranks[i], ".log");
    Argv shown;
    for (const auto& [k, v] : worker_env(plan, node, static_cast<int>(i), restart)) shown.push_back(k + "=" + v);
    if (set_threads) shown.push_back("OMP_NUM_THREADS=" + share);
    if (!blas.coretype.empty()) shown.push_back("OPENBLAS_CORETYPE=" + blas.coretype);
    shown.insert(shown.end(), p.argv.begin(), p.argv.end());
    job.hosts_commands[n.host].push_back(join_command(shown));
    job.procs.push_back(std::move(p));
  }
}

Job build_job(const LaunchOptions& o, const WorldPlan& plan, const std::string& launcher, int node_rank, int restart,
              const LocalMpiWorld* world = nullptr) {
  Job job;
  job.launcher = launcher;
  const EnvList file_env = load_env_files();
  if (launcher == "local") {
    job.node = node_rank;
    local_procs(o, plan, node_rank, file_env, restart, world, job);
    return job;
  }
  const std::string binary = launcher == "openmpi" ? "mpirun" : launcher == "slurm" ? "srun" : launcher;
  if (!o.dry_run && find_in_path(binary).empty()) {
    throw InputError(cat("--launcher ", launcher, ": '", binary, "' is not installed (not found on PATH)"));
  }
  EnvList exports = remote_exports(file_env);
  if (restart > 0) set_env(exports, "TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
  const std::string cwd = current_dir();
  if (launcher == "openmpi" || launcher == "slurm") {
    job.mpi_hostfile_text = mpirun_hostfile(plan);
    job.runner = launcher == "openmpi" ? mpirun_argv(with_pid_holder(o), plan, exports, "<generated hostfile>")
                                       : srun_argv(o, plan, exports);
    for (const auto& n : plan.nodes)
      for (size_t i = 0; i < n.ranks.size(); ++i) job.hosts_commands[n.host].push_back(join_command(o.program));
  } else if (launcher == "ssh") {
    for (size_t k = 0; k < plan.nodes.size(); ++k) {
      const std::string cmd =
          remote_shell_command(cwd, exports, node_launcher_argv(o, plan, static_cast<int>(k), self_exe()));
      job.hosts_commands[plan.nodes[k].host].push_back(cmd);
      ProcSpec p;
      p.label = cat("host ", plan.nodes[k].host, " (ssh)");
      p.argv = ssh_argv(o, plan.nodes[k].host, cmd);
      p.env = make_environment({});
      p.stdin_pipe = true;
      job.procs.push_back(std::move(p));
    }
  } else {  // pdsh: one command for every host; the dry run shows it once, as runner_command
    job.runner = pdsh_argv(o, plan, remote_shell_command(cwd, exports, pdsh_node_launcher_argv(o, plan, self_exe())));
  }
  if (!job.runner.empty()) {
    ProcSpec p;
    p.label = launcher;
    p.argv = job.runner;
    p.env = make_environment(launcher == "pdsh" ? EnvList{{"PDSH_RCMD_TYPE", "ssh"}} : EnvList{});
    p.watch_node_failures = launcher == "pdsh";
    job.procs.push_back(std::move(p));
  }
  return job;
}

// CLI11's usage line ends at [OPTIONS]; launch's arguments go on with the program it starts.
class UsageWithProgram : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string name) const override {
    std::string usage = CLI::Formatter::make_usage(app, std::move(name));
    usage.insert(usage.find_last_not_of('\n') + 1, " PROGRAM [ARGS...]");
    return usage;
  }
};

// The launcher's options, bound to `o` and `hold_pid`; returns --hostfile's (was it given?).
CLI::Option* add_options(CLI::App& app, LaunchOptions& o, bool& hold_pid) {
  auto* hf = app.add_option("-H,--hostfile", o.hostfile, "hostfile: lines 'HOST slots=N' (default /job/hostfile; absent = this machine)");
  app.add_option("-i,--include", o.include, "only these resources: NAME[:SLOT[,SLOT...]][@NAME...]");
  app.add_option("-e,--exclude", o.exclude, "all resources but these: NAME[:SLOT[,SLOT...]][@NAME...]");
  app.add_option("--num_nodes", o.num_nodes, "use the first N hosts");
  app.add_option("--num_gpus,--num_procs", o.num_gpus, "slots per host (on a CPU host a slot is a process)");
  app.add_option("--master_addr", o.master_addr, "rendezvous address (default: the first host)");
  app.add_option("--master_port", o.master_port, "rendezvous port")->default_val(29500);
  app.add_option("--launcher", o.launcher, "local, pdsh, ssh, openmpi, slurm (default: local for this machine, else pdsh, else ssh)")
      ->check(CLI::IsMember({"local", "pdsh", "ssh", "openmpi", "slurm"}));
  app.add_option("--launcher_args", o.launcher_args, "extra arguments for pdsh/ssh/mpirun/srun");
  app.add_option("--node_rank", o.node_rank,
                 "start only this node's ranks: host K of the hostfile (as --no_ssh); without a hostfile, node K of "
                 "--nnodes (torchrun's static rendezvous at --master_addr)");
  app.add_flag("--no_ssh", o.no_ssh, "start only this node's ranks (run launch on every node by hand)");
  app.add_flag("--no_mpi_world", o.no_mpi_world,
               "on one host: do not make the ranks an MPI job through this launcher's PMIx server "
               "(comm_backend auto then picks gloo)");
  app.add_option("--max_restarts", o.max_restarts, "restart the whole group up to N times after a failure")->check(CLI::NonNegativeNumber);
  app.add_option("--log_dir", o.log_dir, "also write each rank's output to LOG_DIR/rank_<R>.log");
  app.add_option("--pid_file", o.pid_file, "while the group runs, list its processes here: 'PID START_TIME LABEL' lines");
  app.add_flag("--no_local_rank", o.no_local_rank, "do not append --local_rank=N to the program's arguments");
  app.add_flag("--dry_run", o.dry_run, "print the plan as JSON and exit");
  app.add_option("--term_timeout", o.term_timeout, "seconds from SIGTERM to SIGKILL when stopping workers")->check(CLI::NonNegativeNumber);
  app.add_option("--slot_type", o.slot_type, "gpu (set CUDA_VISIBLE_DEVICES), cpu, auto")->check(CLI::IsMember({"gpu", "cpu", "auto"}));
  // internal: how a multi-node launch tells each per-node launcher where it stands
  app.add_option("--node_host", o.node_host)->group("");
  app.add_option("--node_slots", o.node_slots)->group("");
  app.add_option("--rank_offset", o.rank_offset)->group("");
  app.add_option("--world_size", o.world_size)->group("");
  app.add_option("--num_nodes_total", o.world_nodes)->group("");
  app.add_option("--slot_layout", o.slot_layout)->group("");
  app.add_flag("--hold_pid", hold_pid, "internal: run PROGRAM for mpirun (pid_holder.h)")->group("");
  return hf;
}

// torchrun's names (torchrun_names.h).
void add_torchrun_options(CLI::App& app, TorchrunNames& t) {
  const char* group = "torchrun's names (docs/launcher.md)";
  app.add_option("--nproc_per_node", t.nproc_per_node, "= --num_gpus: processes per node")->group(group);
  app.add_option("--nnodes", t.nnodes, "= --num_nodes; without a hostfile, nodes of torchrun's static rendezvous")
      ->group(group);
  app.add_option("--rdzv_endpoint", t.rdzv_endpoint, "HOST[:PORT] = --master_addr HOST --master_port PORT")->group(group);
}

// A torchrun name and launch's own name for one setting, both given: which one was meant is unclear.
void refuse_both_names(const CLI::App& app) {
  const char* const pairs[][2] = {{"--nproc_per_node", "--num_gpus"}, {"--nnodes", "--num_nodes"},
                                  {"--rdzv_endpoint", "--master_addr"}, {"--rdzv_endpoint", "--master_port"}};
  for (const auto& [torchrun, own] : pairs)
    PT_INPUT_CHECK(app.get_option(torchrun)->count() == 0 || app.get_option(own)->count() == 0, torchrun, " and ", own,
                   " both given: ", torchrun, " is torchrun's name for ",
                   std::string(torchrun) == "--rdzv_endpoint" ? "--master_addr HOST --master_port PORT" : own,
                   "; give one");
}

// Parses the command line into `o`, PROGRAM and its arguments included; an exit code when that ends the run
// (--help). With --hold_pid it runs PROGRAM itself and does not return.
std::optional<int> parse_command_line(int argc, char** argv, LaunchOptions& o) {
  CLI::App app{"launch: start PROGRAM on every slot of the hosts in a DeepSpeed-style hostfile"};
  app.formatter(std::make_shared<UsageWithProgram>());
  app.get_formatter()->column_width(34);
  app.prefix_command();  // everything from PROGRAM on belongs to PROGRAM
  bool hold_pid = false;
  TorchrunNames torchrun;
  auto* hf = add_options(app, o, hold_pid);
  add_torchrun_options(app, torchrun);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    throw InputError(std::string("command line: ") + e.what() + " (see --help)");
  }
  refuse_both_names(app);
  o.program = app.remaining();
  if (!o.program.empty() && o.program.front() == "--") {
    o.program.erase(o.program.begin());
  } else if (!o.program.empty() && o.program.front().rfind("-", 0) == 0) {
    throw InputError(cli::unknown_argument_message(app, o.program));
  }
  if (o.program.empty()) throw InputError("command line: no PROGRAM given (launch [options] PROGRAM [ARGS...])");
  if (hold_pid) run_holding_pid(o.program);
  o.hostfile_given = hf->count() > 0;
  torchrun.have_hostfile = o.hostfile_given || file_exists(o.hostfile);
  torchrun.default_procs = std::max(1, local_gpu_count());
  apply_torchrun_names(torchrun, o);
  return std::nullopt;
}

// Where and how the job runs, from the command line, the hostfile and the environment.
struct Target {
  WorldPlan plan;
  std::string launcher;
  int node_rank = 0;
  int restart_base = 0;   // a per-node launcher inherits the group's restart count
  bool per_node = false;  // --node_slots/--slot_layout given: a per-node launcher
  bool mpi_world = false;
};

// A per-node launcher's target: this host's slots and ranks as the launcher that started it laid them out.
void per_node_target(const LaunchOptions& o, bool gpu_slots, Target& t) {
  std::vector<int> slots;
  int offset = o.rank_offset, world = o.world_size, nodes = o.world_nodes;
  if (!o.slot_layout.empty()) {
    PT_INPUT_CHECK(o.node_rank >= 0, "--slot_layout needs --node_rank (got ", o.node_rank, ")");
    const NodeView v = node_in_layout(o.slot_layout, o.node_rank);
    slots = v.slots, offset = v.rank_offset, world = v.world_size, nodes = v.num_nodes;
  } else {
    slots = decode_slots(o.node_slots, "--node_slots");
  }
  std::string host = o.node_host;
  if (host.empty()) {  // pdsh: this machine's name (pdsh prefixes every line with it too)
    char name[256] = {0};
    host = gethostname(name, sizeof(name) - 1) == 0 && name[0] ? name : "localhost";
  }
  t.plan = make_node_plan(host, o.node_rank, slots, offset, world, nodes, o.master_addr, o.master_port, gpu_slots);
  hangup_when_parent_dies();  // the ssh session ending stops this node's workers
  t.launcher = "local", t.node_rank = o.node_rank;
  if (const char* r = std::getenv("TORCHELASTIC_RESTART_COUNT")) t.restart_base = std::atoi(r);
}

// The hosts and slots to use: the hostfile's (else this machine's), filtered by --include/--exclude/--num_*.
ResourcePool select_resources(const LaunchOptions& o) {
  if ((o.num_nodes > 0 || o.num_gpus > 0) && (!o.include.empty() || !o.exclude.empty())) {
    throw InputError("--num_nodes/--num_gpus cannot be combined with --include/--exclude");
  }
  ResourcePool pool;
  const bool have_hostfile = o.hostfile_given || file_exists(o.hostfile);
  if (have_hostfile) {
    pool = read_hostfile(o.hostfile);
  } else {
    const int slots = o.num_gpus > 0 ? o.num_gpus : std::max(1, local_gpu_count());
    HostSlots h{"localhost", {}};
    for (int i = 0; i < slots; ++i) h.slots.push_back(i);
    pool.push_back(h);
  }
  pool = limit_resources(filter_resources(pool, o.include, o.exclude), o.num_nodes, o.num_gpus);
  return pool;
}

// The launcher for `pool`: --no_ssh's and --launcher's checked against it, or else chosen (local, pdsh, ssh).
void choose_launcher(const LaunchOptions& o, const ResourcePool& pool, Target& t) {
  std::string& launcher = t.launcher;
  if (o.no_ssh) {
    PT_INPUT_CHECK(o.node_rank >= 0 && o.node_rank < static_cast<int>(pool.size()),
                   "--no_ssh needs --node_rank between 0 and ", pool.size() - 1, " (got ", o.node_rank, ")");
    PT_INPUT_CHECK(launcher.empty() || launcher == "local", "--no_ssh starts this node only; drop --launcher ", launcher);
    launcher = "local", t.node_rank = o.node_rank;
  } else if (launcher.empty()) {
    const bool here = pool.size() == 1 && is_local_host(pool.front().host);
    launcher = here ? "local" : !find_in_path("pdsh").empty() ? "pdsh" : "ssh";
  } else if (launcher == "local") {
    PT_INPUT_CHECK(pool.size() == 1 && is_local_host(pool.front().host), "--launcher local runs on this machine only, but the plan has ",
                   pool.size(), " host(s) starting with '", pool.front().host, "'; use pdsh, ssh, openmpi or slurm");
  }
}

// The plan, launcher and MPI world of this run; PROGRAM resolved where it runs from here.
Target resolve_target(LaunchOptions& o) {
  const bool gpu_slots = o.slot_type == "gpu" || (o.slot_type == "auto" && local_gpu_count() > 0);
  Target t;
  t.launcher = o.launcher;
  t.per_node = !o.node_slots.empty() || !o.slot_layout.empty();
  if (t.per_node) {  // started by pdsh/ssh on one host of a multi-node launch
    per_node_target(o, gpu_slots, t);
  } else {
    const ResourcePool pool = select_resources(o);
    choose_launcher(o, pool, t);
    t.plan = make_plan(pool, o.master_addr, o.master_port, gpu_slots);
  }
  if (t.launcher == "local" || t.launcher == "openmpi" || t.launcher == "slurm") {
    o.program.front() = resolve_program(o.program.front(), t.launcher == "local" && !o.dry_run);
  }

  // One host, several ranks, started here: they can form an MPI job without mpirun (the MPI
  // engine's shared memory is several times Gloo's loopback TCP), unless told not to.
  t.mpi_world = t.launcher == "local" && !t.per_node && t.plan.nodes.size() == 1 && t.plan.world_size > 1 &&
                !o.no_mpi_world && mpi_world_supported();
  return t;
}

// --dry_run: the plan, with the commands each host would run, as JSON on stdout.
void print_dry_run(const LaunchOptions& o, const Target& t) {
  const std::string& launcher = t.launcher;
  const Job job = build_job(o, t.plan, launcher, t.node_rank, 0);
  auto j = plan_to_json(t.plan);
  j["launcher"] = launcher;
  for (auto& h : j["hosts"]) {
    const std::string host = h["host"];
    h["commands"] = job.hosts_commands.contains(host) ? job.hosts_commands[host] : nlohmann::json::array();
  }
  if (!job.runner.empty()) j["runner_command"] = join_command(job.runner);
  if (!job.mpi_hostfile_text.empty() && launcher == "openmpi") j["generated_hostfile"] = job.mpi_hostfile_text;
  j["mpi_world"] = t.mpi_world ? "pmix" : launcher == "openmpi" || launcher == "slurm" ? launcher : "none";
  std::cout << j.dump(2) << std::endl;
}

// --log_dir created and --pid_file found writable, before anything starts.
void prepare_outputs(const LaunchOptions& o) {
  if (!o.log_dir.empty()) make_dirs(o.log_dir);
  if (!o.pid_file.empty()) {  // a bad path is bad input, found before anything starts
    FILE* f = std::fopen((o.pid_file + ".tmp").c_str(), "w");
    if (!f) throw InputError(cat("--pid_file: cannot write '", o.pid_file, "': ", std::strerror(errno)));
    std::fclose(f);
    unlink((o.pid_file + ".tmp").c_str());
  }
}

// Writes the hosts mpirun is to read to a temporary file and points the job's mpirun at it; the file's path.
std::string write_mpi_hostfile(const LaunchOptions& o, const WorldPlan& plan, Job& job) {
  char tmpl[] = "/tmp/polytrain-mpi-hostfile-XXXXXX";
  const int fd = mkstemp(tmpl);
  PT_CHECK(fd >= 0, "mkstemp");
  const std::string mpi_hostfile = tmpl;
  PT_CHECK(write(fd, job.mpi_hostfile_text.data(), job.mpi_hostfile_text.size()) ==
               static_cast<ssize_t>(job.mpi_hostfile_text.size()), "write ", mpi_hostfile);
  close(fd);
  job.procs.back().argv = mpirun_argv(with_pid_holder(o), plan, remote_exports(load_env_files()), mpi_hostfile);
  return mpi_hostfile;
}

// The "launch: ..." line that says what an attempt starts.
void announce(const LaunchOptions& o, const Target& t, const LocalMpiWorld* world, const std::string& no_world,
              int attempt) {
  const WorldPlan& plan = t.plan;
  std::fprintf(stderr, "launch: %s, world size %d on %d host(s), master %s:%d%s%s\n", t.launcher.c_str(),
               plan.world_size, plan.num_nodes, plan.master_addr.c_str(), plan.master_port,
               world ? ", MPI world through this launcher's PMIx server"
               : t.mpi_world ? cat(", no MPI world (", no_world, ")").c_str() : "",
               attempt ? cat(", restart ", attempt, " of ", o.max_restarts).c_str() : "");
}

// Rank 0 binds the rendezvous port when it runs here: a port in use is said before anything starts.
void warn_if_master_port_busy(const Target& t) {
  if (t.launcher != "local" || t.plan.world_size < 2 || !is_local_host(t.plan.master_addr)) return;
  const auto& here = t.plan.nodes.at(t.node_rank - t.plan.first_node);
  if (here.ranks.empty() || here.ranks.front() != 0) return;
  const std::string warning = master_port_warning(t.plan.master_port);
  if (!warning.empty()) std::fprintf(stderr, "%s\n", warning.c_str());
}

// Starts and supervises the group, again after a failure up to --max_restarts times; the exit code.
int supervise_attempts(const LaunchOptions& o, const Target& t) {
  SuperviseOptions so;
  so.term_timeout = o.term_timeout;
  so.pid_file = o.pid_file;
  so.replacements = o.max_restarts;
  for (int attempt = 0;; ++attempt) {
    std::unique_ptr<LocalMpiWorld> world;
    std::string no_world;
    if (t.mpi_world) world = LocalMpiWorld::create(t.plan.world_size, t.restart_base + attempt, no_world);
    Job job = build_job(o, t.plan, t.launcher, t.node_rank, t.restart_base + attempt, world.get());
    std::string mpi_hostfile;
    if (t.launcher == "openmpi") {  // mpirun reads the selected hosts from a file we write
      mpi_hostfile = write_mpi_hostfile(o, t.plan, job);
    }
    if (attempt == 0 || t.launcher != "local" || t.node_rank == 0) announce(o, t, world.get(), no_world, attempt);
    const Outcome out = supervise(job.procs, so);
    if (!mpi_hostfile.empty()) unlink(mpi_hostfile.c_str());
    if (t.per_node && out.failed >= 0) {  // tell the launcher that started this node
      std::fprintf(stderr, "%s\n", node_failure_line(t.node_rank, out.exit_code).c_str());
    }
    if (out.exit_code == 0 || out.launcher_signal != 0 || attempt >= o.max_restarts) return out.exit_code;
    std::fprintf(stderr, "launch: restarting the group (restart %d of %d)\n", attempt + 1, o.max_restarts);
  }
}

int run(int argc, char** argv) {
  LaunchOptions o;
  if (const std::optional<int> done = parse_command_line(argc, argv, o)) return *done;
  const Target t = resolve_target(o);
  if (o.dry_run) {
    print_dry_run(o, t);
    return 0;
  }
  prepare_outputs(o);
  warn_if_master_port_busy(t);
  return supervise_attempts(o, t);
}

}  // namespace

int main(int argc, char** argv) {
  return run_main([&] { return run(argc, argv); });
}
