// torchrun's names mapped onto launch's options (torchrun_names.h). torchrun starts each node
// by hand; launch starts every node from a hostfile unless told (--no_ssh) to start one.
#include "polytrain/launcher/torchrun_names.h"

#include <cctype>

#include "polytrain/common/error.h"
#include "polytrain/launcher/hostfile.h"

namespace polytrain::launcher {
namespace {

using ::polytrain::detail::cat;

bool all_digits(const std::string& s) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

int positive(const std::string& text, const std::string& flag, const std::string& otherwise) {
  PT_INPUT_CHECK(all_digits(text) && std::stoi(text) > 0, flag, " ", text, ": ", otherwise);
  return std::stoi(text);
}

int nproc_per_node(const std::string& text) {
  return positive(text, "--nproc_per_node",
                  "give a number of processes per node (without it launch starts one per GPU of this machine, "
                  "one on a CPU machine; launch's own name is --num_gpus)");
}

int nnodes(const std::string& text) {
  PT_INPUT_CHECK(text.find(':') == std::string::npos, "--nnodes ", text,
                 ": elastic node ranges are not supported; give a number of nodes (launch's --num_nodes N uses "
                 "the first N hosts of the hostfile; --max_restarts restarts a failed group)");
  return positive(text, "--nnodes", "give a number of nodes (launch's own name is --num_nodes)");
}

void rdzv_endpoint(const std::string& text, LaunchOptions& o) {
  const size_t colon = text.rfind(':');
  const std::string host = text.substr(0, colon);
  PT_INPUT_CHECK(!host.empty() && valid_host_name(host), "--rdzv_endpoint ", text,
                 ": give HOST[:PORT] of node 0 (the same as --master_addr HOST --master_port PORT)");
  o.master_addr = host;
  if (colon == std::string::npos) return;
  const std::string port = text.substr(colon + 1);
  PT_INPUT_CHECK(all_digits(port) && std::stoi(port) > 0 && std::stoi(port) < 65536, "--rdzv_endpoint ", text,
                 ": '", port, "' is not a TCP port (HOST[:PORT], as --master_addr HOST --master_port PORT)");
  o.master_port = std::stoi(port);
}

// torchrun's static rendezvous without a hostfile: this node's ranks of a world laid out node by
// node, told to launch as a multi-node launch tells each of its per-node launchers.
void static_rendezvous(const TorchrunNames& t, int nodes, LaunchOptions& o) {
  const int node = o.node_rank < 0 ? 0 : o.node_rank;
  PT_INPUT_CHECK(node < nodes, "--node_rank ", node, " is not below --nnodes ", nodes);
  PT_INPUT_CHECK(!o.master_addr.empty(), "--nnodes ", nodes, " without a hostfile needs --master_addr (or "
                 "--rdzv_endpoint): node 0's address, the same on every node; or list the hosts in a hostfile "
                 "and run launch once (--hostfile F)");
  const int procs = o.num_gpus > 0 ? o.num_gpus : t.default_procs;
  std::vector<int> slots;
  for (int i = 0; i < procs; ++i) slots.push_back(i);
  o.node_slots = encode_slots(slots);
  o.node_rank = node, o.rank_offset = node * procs, o.world_size = nodes * procs, o.world_nodes = nodes;
}

}  // namespace

void apply_torchrun_names(const TorchrunNames& t, LaunchOptions& o) {
  if (!t.nproc_per_node.empty()) o.num_gpus = nproc_per_node(t.nproc_per_node);
  if (!t.rdzv_endpoint.empty()) rdzv_endpoint(t.rdzv_endpoint, o);
  const int nodes = t.nnodes.empty() ? -1 : nnodes(t.nnodes);
  const bool started_per_node = !o.node_slots.empty() || !o.slot_layout.empty();  // by ssh/pdsh
  if (started_per_node) return;
  if (t.have_hostfile) {
    if (nodes > 0) o.num_nodes = nodes;
    if (o.node_rank >= 0) o.no_ssh = true;
    return;
  }
  if (nodes > 1 || (nodes > 0 && o.node_rank > 0)) return static_rendezvous(t, nodes, o);
  PT_INPUT_CHECK(o.node_rank <= 0 || o.no_ssh, "--node_rank ", o.node_rank,
                 " without a hostfile needs --nnodes (torchrun's static rendezvous, with --master_addr), or "
                 "--hostfile F to start host ", o.node_rank, " of F");
}

}  // namespace polytrain::launcher
