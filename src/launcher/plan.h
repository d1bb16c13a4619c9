// The world plan: which global and local ranks run on which host, the rendezvous address,
// and the torchrun/DeepSpeed environment each worker receives. Pure; no processes here.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "polytrain/launcher/hostfile.h"

namespace polytrain::launcher {

struct NodePlan {
  std::string host;
  std::vector<int> slots;        ///< slot ids (GPU indices when the slots are GPUs)
  std::vector<int> ranks;        ///< global ranks, consecutive, in hostfile order
  std::vector<int> local_ranks;  ///< 0..slots-1
};

struct WorldPlan {
  std::string master_addr;
  int master_port = 29500;
  int world_size = 0;
  bool gpu_slots = false;  ///< slots are GPUs: workers get CUDA_VISIBLE_DEVICES
  int num_nodes = 0;       ///< nodes in the world
  int first_node = 0;      ///< node index of nodes[0] (a per-node launcher holds only its own node)
  std::vector<NodePlan> nodes;
};

/// Ranks are assigned host by host in pool order. master_addr empty = the first host
/// (127.0.0.1 when that host is this machine).
WorldPlan make_plan(const ResourcePool& pool, const std::string& master_addr, int master_port, bool gpu_slots);

/// What a per-node launcher knows: its own node `node_index` (host, slots, first global rank)
/// of a world of `world_size` ranks on `num_nodes` nodes. Nothing here grows with the hosts.
WorldPlan make_node_plan(const std::string& host, int node_index, const std::vector<int>& slots, int rank_offset,
                         int world_size, int num_nodes, const std::string& master_addr, int master_port,
                         bool gpu_slots);

/// The environment of local rank `local_index` on node `node_index`: RANK, LOCAL_RANK,
/// WORLD_SIZE, LOCAL_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, CROSS_RANK, CROSS_SIZE, MASTER_ADDR,
/// MASTER_PORT, TORCHELASTIC_RESTART_COUNT and, for GPU slots, CUDA_VISIBLE_DEVICES (this
/// node's selected slots, so LOCAL_RANK indexes them as DeepSpeed's launcher does).
std::map<std::string, std::string> worker_env(const WorldPlan& plan, int node_index, int local_index,
                                              int restart_count);

/// True for localhost, 127.x, ::1 and this machine's own host name.
bool is_local_host(const std::string& host);

nlohmann::json plan_to_json(const WorldPlan& plan);

}  // namespace polytrain::launcher
