#include "polytrain/launcher/hostfile.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <sstream>

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

const HostSlots* find_host(const ResourcePool& pool, const std::string& host) {
  for (const auto& h : pool)
    if (h.host == host) return &h;
  return nullptr;
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
    if (n <= 0) throw InputError(cat(source, ":", line_no, ": host '", host, "' has slots=", n, " (must be > 0)"));
    if (host.find_first_of(":@,") != std::string::npos) {
      throw InputError(cat(source, ":", line_no, ": host name '", host, "' contains ':', '@' or ','"));
    }
    if (find_host(pool, host)) {
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
  std::map<std::string, std::vector<int>> chosen;  // host -> slots named (include) or left (exclude)
  if (!inc)
    for (const auto& h : pool) chosen[h.host] = h.slots;
  for (const auto& want : parse_filter_spec(inc ? include : exclude, flag)) {
    const HostSlots* have = find_host(pool, want.host);
    if (!have) throw InputError(cat(flag, ": host '", want.host, "' is not in the hostfile"));
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
  for (auto& h : parse_filter_spec(text, "--world_info")) {
    if (h.slots.empty()) throw InputError(cat("--world_info '", text, "': host '", h.host, "' has no slots"));
    if (find_host(pool, h.host)) throw InputError(cat("--world_info '", text, "': host '", h.host, "' repeated"));
    pool.push_back(std::move(h));
  }
  return pool;
}

}  // namespace polytrain::launcher
