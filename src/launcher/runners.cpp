#include "polytrain/launcher/runners.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "polytrain/common/error.h"

extern char** environ;

namespace polytrain::launcher {
namespace {

using ::polytrain::detail::cat;

std::string host_list(const WorldPlan& plan) {
  std::string s;
  for (const auto& n : plan.nodes) s += (s.empty() ? "" : ",") + n.host;
  return s;
}

// mpirun and srun place k processes on slots 0..k-1 of each host: a DeepSpeed-style slot
// selection such as worker-0:1,3 cannot be expressed to them.
void require_leading_slots(const WorldPlan& plan, const std::string& runner) {
  for (const auto& n : plan.nodes) {
    for (size_t i = 0; i < n.slots.size(); ++i) {
      if (n.slots[i] != static_cast<int>(i)) {
        throw InputError(cat("--launcher ", runner, " places ranks on slots 0..k-1 only, but host '", n.host,
                             "' selects slot ", n.slots[i], " at position ", i, "; use --launcher pdsh or ssh"));
      }
    }
  }
}

void append(Argv& a, const Argv& b) { a.insert(a.end(), b.begin(), b.end()); }

}  // namespace

std::string shell_quote(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+=/.,:@%") ==
                        std::string::npos) {
    return w;
  }
  std::string q = "'";
  for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string join_command(const Argv& argv) {
  std::string s;
  for (const auto& w : argv) s += (s.empty() ? "" : " ") + shell_quote(w);
  return s;
}

Argv split_words(const std::string& s) {
  Argv out;
  std::istringstream in(s);
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

Argv worker_argv(const LaunchOptions& o, int local_rank) {
  Argv a = o.program;
  if (!o.no_local_rank) a.push_back("--local_rank=" + std::to_string(local_rank));
  return a;
}

namespace {
// What every per-node launcher receives after its node's own description.
Argv node_launcher_tail(const LaunchOptions& o, const WorldPlan& plan) {
  Argv a{"--master_addr", plan.master_addr, "--master_port", std::to_string(plan.master_port), "--slot_type",
         o.slot_type, "--term_timeout", std::to_string(o.term_timeout)};
  if (o.no_local_rank) a.push_back("--no_local_rank");
  if (!o.log_dir.empty()) append(a, {"--log_dir", o.log_dir});
  a.push_back("--");
  append(a, o.program);
  return a;
}
}  // namespace

Argv node_launcher_argv(const LaunchOptions& o, const WorldPlan& plan, int node_index, const std::string& self_exe) {
  const NodePlan& n = plan.nodes.at(node_index - plan.first_node);
  Argv a{self_exe, "--node_host", n.host, "--node_rank", std::to_string(node_index), "--node_slots",
         encode_slots(n.slots), "--rank_offset", std::to_string(n.ranks.front()), "--world_size",
         std::to_string(plan.world_size), "--num_nodes_total", std::to_string(plan.num_nodes)};
  append(a, node_launcher_tail(o, plan));
  return a;
}

Argv pdsh_node_launcher_argv(const LaunchOptions& o, const WorldPlan& plan, const std::string& self_exe) {
  ResourcePool pool;
  for (const auto& n : plan.nodes) pool.push_back({"", n.slots});
  Argv a{self_exe, "--slot_layout", encode_slot_layout(pool), "--node_rank", "%n"};
  append(a, node_launcher_tail(o, plan));
  return a;
}

std::string remote_shell_command(const std::string& cwd, const EnvList& exports, const Argv& argv) {
  std::string s = "cd " + shell_quote(cwd) + " && exec env";
  for (const auto& [k, v] : exports) s += " " + shell_quote(k + "=" + v);
  return s + " " + join_command(argv);
}

Argv pdsh_argv(const LaunchOptions& o, const WorldPlan& plan, const std::string& remote_command) {
  Argv a{"pdsh", "-S", "-f", "1024", "-w", host_list(plan)};
  append(a, split_words(o.launcher_args));
  a.push_back(remote_command);
  return a;
}

Argv ssh_argv(const LaunchOptions& o, const std::string& host, const std::string& remote_command) {
  Argv a{"ssh"};
  append(a, split_words(o.launcher_args));
  append(a, {host, remote_command});
  return a;
}

std::string mpirun_hostfile(const WorldPlan& plan) {
  std::string s;
  for (const auto& n : plan.nodes) s += n.host + " slots=" + std::to_string(n.slots.size()) + "\n";
  return s;
}

Argv mpirun_argv(const LaunchOptions& o, const WorldPlan& plan, const EnvList& exports,
                 const std::string& generated_hostfile) {
  require_leading_slots(plan, "openmpi");
  Argv a{"mpirun", "-n", std::to_string(plan.world_size), "-hostfile", generated_hostfile};
  // Open MPI refuses to start as root without this; containers and CI commonly run as root.
  if (geteuid() == 0) a.push_back("--allow-run-as-root");
  a.push_back("--tag-output");  // "[1,R]<stdout>:" before each line: which rank said it
  append(a, {"-x", "MASTER_ADDR=" + plan.master_addr, "-x", "MASTER_PORT=" + std::to_string(plan.master_port)});
  for (const auto& [k, v] : exports) append(a, {"-x", k + "=" + v});
  append(a, split_words(o.launcher_args));
  append(a, o.program);
  return a;
}

Argv srun_argv(const LaunchOptions& o, const WorldPlan& plan, const EnvList& exports) {
  require_leading_slots(plan, "slurm");
  const size_t per_node = plan.nodes.front().slots.size();
  for (const auto& n : plan.nodes) {
    if (n.slots.size() != per_node) {
      throw InputError(cat("--launcher slurm needs the same number of slots on every host ('", plan.nodes.front().host,
                           "' has ", per_node, ", '", n.host, "' has ", n.slots.size(), ")"));
    }
  }
  std::string exp = "ALL,MASTER_ADDR=" + plan.master_addr + ",MASTER_PORT=" + std::to_string(plan.master_port);
  for (const auto& [k, v] : exports) {
    if (v.find(',') != std::string::npos) throw InputError(cat("--launcher slurm: the value of ", k, " contains ','"));
    exp += "," + k + "=" + v;
  }
  Argv a{"srun", "-n", std::to_string(plan.world_size), "--nodelist", host_list(plan), "--ntasks-per-node",
         std::to_string(per_node), "--export=" + exp};
  append(a, split_words(o.launcher_args));
  append(a, o.program);
  return a;
}

std::string find_in_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::istringstream in(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(in, dir, ':')) {
    const std::string p = (dir.empty() ? "." : dir) + "/" + name;
    struct stat st {};
    if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

EnvList remote_exports(const EnvList& env_file_entries) {
  EnvList out;
  // The sanitizers' options too: a sanitized build run across hosts keeps its settings (a
  // remote rank would otherwise fall back to the runtime's defaults, e.g. ASan's fast unwinder).
  static const char* kPrefixes[] = {"NCCL_", "GLOO_", "OMP_", "UCX_", "POLYTRAIN_",
                                    "ASAN_", "LSAN_", "UBSAN_", "TSAN_"};
  for (char** e = environ; e && *e; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq);
    bool take = k == "PATH" || k == "LD_LIBRARY_PATH";
    for (const char* p : kPrefixes) take = take || k.rfind(p, 0) == 0;
    if (take) set_env(out, k, kv.substr(eq + 1));
  }
  for (const auto& [k, v] : env_file_entries) set_env(out, k, v);
  return out;
}

}  // namespace polytrain::launcher
