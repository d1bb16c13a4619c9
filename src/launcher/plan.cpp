#include "polytrain/launcher/plan.h"

#include <unistd.h>

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
  return plan;
}

std::map<std::string, std::string> worker_env(const WorldPlan& plan, int node_index, int local_index,
                                              int restart_count) {
  const NodePlan& node = plan.nodes.at(node_index);
  const auto s = [](auto v) { return std::to_string(v); };
  std::map<std::string, std::string> env{
      {"RANK", s(node.ranks.at(local_index))},
      {"LOCAL_RANK", s(node.local_ranks.at(local_index))},
      {"WORLD_SIZE", s(plan.world_size)},
      {"LOCAL_SIZE", s(node.ranks.size())},
      {"LOCAL_WORLD_SIZE", s(node.ranks.size())},
      {"GROUP_RANK", s(node_index)},
      {"CROSS_RANK", s(node_index)},
      {"CROSS_SIZE", s(plan.nodes.size())},
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
