#include "polytrain/launcher/plan.h"

#include <unistd.h>

#include <cstdint>

#include <nlohmann/json.hpp>

#include "polytrain/common/error.h"

namespace polytrain::launcher {

bool is_local_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return false;
  const std::string self(name);
  return host == self || (self.find('.') != std::string::npos && host == self.substr(0, self.find('.')));
}

WorldPlan make_plan(const ResourcePool& pool, const std::string& master_addr, int master_port, bool gpu_slots) {
  PT_INPUT_CHECK(!pool.empty(), "nothing to run: no host has a slot left");
  PT_INPUT_CHECK(master_port > 0 && master_port < 65536, "--master_port ", master_port, " is not a TCP port");
  PT_INPUT_CHECK(master_addr.empty() || valid_host_name(master_addr), "--master_addr: '", master_addr.substr(0, 80),
                 "' is not a host name or IPv4 address");
  WorldPlan plan;
  plan.master_port = master_port;
  plan.gpu_slots = gpu_slots;
  plan.master_addr = !master_addr.empty()              ? master_addr
                     : is_local_host(pool.front().host) ? "127.0.0.1"
                                                        : pool.front().host;
  int rank = 0;
  for (const auto& h : pool) {
    NodePlan n{h.host, h.slots, {}, {}};
    for (size_t i = 0; i < h.slots.size(); ++i) {
      n.ranks.push_back(rank++);
      n.local_ranks.push_back(static_cast<int>(i));
    }
    plan.nodes.push_back(std::move(n));
  }
  plan.world_size = rank;
  plan.num_nodes = static_cast<int>(plan.nodes.size());
  return plan;
}

WorldPlan make_node_plan(const std::string& host, int node_index, const std::vector<int>& slots, int rank_offset,
                         int world_size, int num_nodes, const std::string& master_addr, int master_port,
                         bool gpu_slots) {
  PT_INPUT_CHECK(num_nodes > 0 && node_index >= 0 && node_index < num_nodes, "--node_rank ", node_index,
                 " is not a node of a world of ", num_nodes, " node(s)");
  PT_INPUT_CHECK(!slots.empty() && rank_offset >= 0 && rank_offset + static_cast<int64_t>(slots.size()) <= world_size,
                 "node ", node_index, ": ranks ", rank_offset, "..", rank_offset + static_cast<int64_t>(slots.size()) - 1,
                 " do not fit a world of size ", world_size);
  PT_INPUT_CHECK(master_port > 0 && master_port < 65536, "--master_port ", master_port, " is not a TCP port");
  PT_INPUT_CHECK(valid_host_name(master_addr), "--master_addr: '", master_addr.substr(0, 80), "' is not a host name");
  WorldPlan plan;
  plan.master_addr = master_addr;
  plan.master_port = master_port;
  plan.gpu_slots = gpu_slots;
  plan.world_size = world_size;
  plan.num_nodes = num_nodes;
  plan.first_node = node_index;
  NodePlan n{host, slots, {}, {}};
  for (size_t i = 0; i < slots.size(); ++i) {
    n.ranks.push_back(rank_offset + static_cast<int>(i));
    n.local_ranks.push_back(static_cast<int>(i));
  }
  plan.nodes.push_back(std::move(n));
  return plan;
}

std::map<std::string, std::string> worker_env(const WorldPlan& plan, int node_index, int local_index,
                                              int restart_count) {
  const NodePlan& node = plan.nodes.at(node_index - plan.first_node);
  const auto s = [](auto v) { return std::to_string(v); };
  std::map<std::string, std::string> env{
      {"RANK", s(node.ranks.at(local_index))},
      {"LOCAL_RANK", s(node.local_ranks.at(local_index))},
      {"WORLD_SIZE", s(plan.world_size)},
      {"LOCAL_SIZE", s(node.ranks.size())},
      {"LOCAL_WORLD_SIZE", s(node.ranks.size())},
      {"GROUP_RANK", s(node_index)},
      {"CROSS_RANK", s(node_index)},
      {"CROSS_SIZE", s(plan.num_nodes)},
      {"MASTER_ADDR", plan.master_addr},
      {"MASTER_PORT", s(plan.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", s(restart_count)},
  };
  if (plan.gpu_slots) {
    std::string devices;
    for (int slot : node.slots) devices += (devices.empty() ? "" : ",") + s(slot);
    env["CUDA_VISIBLE_DEVICES"] = devices;
  }
  return env;
}

nlohmann::json plan_to_json(const WorldPlan& plan) {
  nlohmann::json j{{"world_size", plan.world_size},
                   {"master_addr", plan.master_addr},
                   {"master_port", plan.master_port},
                   {"gpu_slots", plan.gpu_slots},
                   {"hosts", nlohmann::json::array()}};
  for (const auto& n : plan.nodes) {
    j["hosts"].push_back({{"host", n.host}, {"slots", n.slots}, {"ranks", n.ranks}, {"local_ranks", n.local_ranks}});
  }
  return j;
}

}  // namespace polytrain::launcher
