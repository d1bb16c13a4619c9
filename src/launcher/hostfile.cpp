#include "polytrain/launcher/hostfile.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "polytrain/common/error.h"

namespace polytrain::launcher {
namespace {

using ::polytrain::detail::cat;

bool parse_int(const std::string& s, int& out) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  out = std::stoi(s);
  return true;
}

// Printable, bounded: how a bad name appears inside an error message.
std::string shown(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return s.size() > 80 ? out + "..." : out;
}

// "N" or "A-B" parts joined by ','; a bound of 2^20 keeps a hostile range from allocating.
bool parse_slot_list(const std::string& text, std::vector<int>& out) {
  constexpr int kMaxSlot = 1 << 20;
  out.clear();
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto dash = part.find('-');
    int a = 0, b = 0;
    if (!parse_int(part.substr(0, dash), a)) return false;
    b = a;
    if (dash != std::string::npos && !parse_int(part.substr(dash + 1), b)) return false;
    if (b < a || b >= kMaxSlot || (!out.empty() && a <= out.back())) return false;
    if (out.size() + static_cast<size_t>(b - a) + 1 > static_cast<size_t>(kMaxSlot)) return false;
    for (int v = a; v <= b; ++v) out.push_back(v);
  }
  return !out.empty() && !text.empty() && text.back() != ',';
}

}  // namespace

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<std::pair<int, std::string>> content_lines(const std::string& text) {
  std::vector<std::pair<int, std::string>> out;
  std::istringstream in(text);
  std::string raw;
  for (int line_no = 1; std::getline(in, raw); ++line_no) {
    std::string line = trim(raw);
    if (!line.empty() && line[0] != '#') out.emplace_back(line_no, std::move(line));
  }
  return out;
}

ResourcePool parse_hostfile(const std::string& text, const std::string& source) {
  ResourcePool pool;
  std::unordered_set<std::string> seen;
  for (auto [line_no, line] : content_lines(text)) {
    const std::string raw = line;
    if (auto hash = line.find('#'); hash != std::string::npos) line = trim(line.substr(0, hash));
    std::istringstream fields(line);
    std::string host, slots, extra;
    fields >> host >> slots >> extra;
    int n = 0;
    const bool ok = slots.rfind("slots=", 0) == 0 && parse_int(slots.substr(6), n) && extra.empty();
    if (!ok) {
      throw InputError(cat(source, ":", line_no, ": bad hostfile entry '", trim(raw),
                           "' (expected 'HOSTNAME slots=N')"));
    }
    if (n <= 0 || n > 65536) {
      throw InputError(cat(source, ":", line_no, ": host '", shown(host), "' has slots=", n, " (must be 1 to 65536)"));
    }
    if (!valid_host_name(host)) {
      throw InputError(cat(source, ":", line_no, ": '", shown(host),
                           "' is not a host name (letters, digits, '-', '_', '.'; labels of at most 63, "
                           "at most 253 in all)"));
    }
    if (!seen.insert(host).second) {
      throw InputError(cat(source, ":", line_no, ": host '", host, "' is listed more than once"));
    }
    HostSlots h{host, {}};
    for (int i = 0; i < n; ++i) h.slots.push_back(i);
    pool.push_back(std::move(h));
  }
  if (pool.empty()) throw InputError(cat(source, ": hostfile lists no host (expected lines 'HOSTNAME slots=N')"));
  return pool;
}

ResourcePool read_hostfile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(cat("hostfile '", path, "' cannot be read"));
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_hostfile(ss.str(), path);
}

std::vector<HostSlots> parse_filter_spec(const std::string& spec, const std::string& flag) {
  std::vector<HostSlots> out;
  std::istringstream in(spec);
  std::string part;
  while (std::getline(in, part, '@')) {
    const auto colon = part.find(':');
    HostSlots h{part.substr(0, colon), {}};
    if (h.host.empty()) throw InputError(cat(flag, " '", spec, "': empty host name"));
    if (colon != std::string::npos) {
      std::istringstream slots(part.substr(colon + 1));
      std::string s;
      while (std::getline(slots, s, ',')) {
        int v = 0;
        if (!parse_int(s, v)) throw InputError(cat(flag, " '", spec, "': slot '", s, "' of host '", h.host, "' is not a number"));
        h.slots.push_back(v);
      }
      if (h.slots.empty()) throw InputError(cat(flag, " '", spec, "': host '", h.host, "' has ':' but no slots"));
    }
    out.push_back(std::move(h));
  }
  if (out.empty() || (!spec.empty() && spec.back() == '@')) throw InputError(cat(flag, " '", spec, "': empty host name"));
  return out;
}

ResourcePool filter_resources(const ResourcePool& pool, const std::string& include, const std::string& exclude) {
  if (!include.empty() && !exclude.empty()) throw InputError("--include and --exclude cannot be used together");
  if (include.empty() && exclude.empty()) return pool;
  const bool inc = !include.empty();
  const std::string flag = inc ? "--include" : "--exclude";
  std::unordered_map<std::string, const HostSlots*> index;
  for (const auto& h : pool) index.emplace(h.host, &h);
  std::unordered_map<std::string, std::vector<int>> chosen;  // host -> slots named (include) or left (exclude)
  if (!inc)
    for (const auto& h : pool) chosen[h.host] = h.slots;
  for (const auto& want : parse_filter_spec(inc ? include : exclude, flag)) {
    const auto found = index.find(want.host);
    if (found == index.end()) throw InputError(cat(flag, ": host '", shown(want.host), "' is not in the hostfile"));
    const HostSlots* have = found->second;
    for (int s : want.slots) {
      if (std::find(have->slots.begin(), have->slots.end(), s) == have->slots.end()) {
        throw InputError(cat(flag, ": host '", want.host, "' has no slot ", s, " (it has ", have->slots.size(), ")"));
      }
    }
    auto& slots = chosen[want.host];
    const auto& named = want.slots.empty() ? have->slots : want.slots;
    if (inc) {
      slots.insert(slots.end(), named.begin(), named.end());
      std::sort(slots.begin(), slots.end());
      slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    } else {
      for (int s : named) slots.erase(std::remove(slots.begin(), slots.end(), s), slots.end());
    }
  }
  ResourcePool out;
  for (const auto& h : pool) {  // hostfile order is rank order
    auto it = chosen.find(h.host);
    if (it != chosen.end() && !it->second.empty()) out.push_back({h.host, it->second});
  }
  if (out.empty()) throw InputError(cat(flag, " '", inc ? include : exclude, "' leaves nothing to run"));
  return out;
}

ResourcePool limit_resources(const ResourcePool& pool, int num_nodes, int num_gpus) {
  ResourcePool out = pool;
  if (num_nodes > 0) {
    if (num_nodes > static_cast<int>(out.size())) {
      throw InputError(cat("--num_nodes ", num_nodes, ": the hostfile lists only ", out.size(), " host(s)"));
    }
    out.resize(num_nodes);
  }
  if (num_gpus > 0) {
    for (auto& h : out) {
      if (num_gpus > static_cast<int>(h.slots.size())) {
        throw InputError(cat("--num_gpus ", num_gpus, ": host '", h.host, "' has only ", h.slots.size(), " slot(s)"));
      }
      h.slots.resize(num_gpus);
    }
  }
  return out;
}

std::string encode_pool(const ResourcePool& pool) {
  std::string s;
  for (const auto& h : pool) {
    if (!s.empty()) s += '@';
    s += h.host;
    for (size_t i = 0; i < h.slots.size(); ++i) s += (i ? "," : ":") + std::to_string(h.slots[i]);
  }
  return s;
}

ResourcePool decode_pool(const std::string& text) {
  ResourcePool pool;
  std::unordered_set<std::string> seen;
  for (auto& h : parse_filter_spec(text, "pool")) {
    if (h.slots.empty()) throw InputError(cat("pool '", text, "': host '", h.host, "' has no slots"));
    if (!seen.insert(h.host).second) throw InputError(cat("pool '", text, "': host '", h.host, "' repeated"));
    pool.push_back(std::move(h));
  }
  return pool;
}

bool valid_host_name(const std::string& host) {
  if (host.empty() || host.size() > 253) return false;
  size_t label = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(host[i]);
    if (c == '.') {
      if (label == 0) return false;  // "", ".x", "x..y"
      label = 0;
      continue;
    }
    if (!std::isalnum(c) && c != '-' && c != '_') return false;
    if (++label > 63) return false;
  }
  return label > 0 || host.size() > 1;  // a trailing dot (absolute name) is fine
}

std::string encode_slots(const std::vector<int>& slots) {
  std::string s;
  for (size_t i = 0; i < slots.size();) {
    size_t j = i;
    while (j + 1 < slots.size() && slots[j + 1] == slots[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(slots[i]);
    if (j > i) s += "-" + std::to_string(slots[j]);
    i = j + 1;
  }
  return s;
}

std::vector<int> decode_slots(const std::string& text, const std::string& flag) {
  std::vector<int> out;
  if (!parse_slot_list(text, out)) {
    throw InputError(cat(flag, " '", shown(text), "': not a slot list (e.g. 0-7 or 1,3: ascending, below 2^20)"));
  }
  return out;
}

std::string encode_slot_layout(const ResourcePool& pool) {
  std::string s;
  for (size_t i = 0; i < pool.size();) {
    size_t j = i;
    while (j + 1 < pool.size() && pool[j + 1].slots == pool[i].slots) ++j;
    if (!s.empty()) s += '@';
    s += std::to_string(j - i + 1) + "x" + encode_slots(pool[i].slots);
    i = j + 1;
  }
  return s;
}

NodeView node_in_layout(const std::string& layout, int node_rank) {
  NodeView v;
  bool found = false;
  std::istringstream in(layout);
  std::string run;
  while (std::getline(in, run, '@')) {
    const auto x = run.find('x');
    int count = 0;
    if (x == std::string::npos || !parse_int(run.substr(0, x), count) || count <= 0) {
      throw InputError(cat("--slot_layout '", shown(layout), "': run '", shown(run), "' is not COUNTxSLOTS"));
    }
    const auto slots = decode_slots(run.substr(x + 1), "--slot_layout");
    const int64_t world = static_cast<int64_t>(v.world_size) + static_cast<int64_t>(count) * static_cast<int64_t>(slots.size());
    PT_INPUT_CHECK(world < (1 << 30) && static_cast<int64_t>(v.num_nodes) + count < (1 << 30), "--slot_layout '",
                   shown(layout), "': more than 2^30 ranks or nodes");
    if (!found && node_rank >= v.num_nodes && node_rank < v.num_nodes + count) {
      found = true;
      v.slots = slots;
      v.rank_offset = v.world_size + (node_rank - v.num_nodes) * static_cast<int>(slots.size());
    }
    v.world_size = static_cast<int>(world);
    v.num_nodes += count;
  }
  PT_INPUT_CHECK(found, "--node_rank ", node_rank, " is not a node of --slot_layout '", shown(layout), "' (",
                 v.num_nodes, " nodes)");
  return v;
}

}  // namespace polytrain::launcher
