#include "polytrain/common/self_launch.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace fs = std::filesystem;
using detail::cat;

namespace {

bool executable(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
}

std::string find_launch_for(const std::string& exe) {
  if (const char* v = std::getenv("POLYTRAIN_LAUNCH"); v && *v) return v;
  if (!exe.empty()) {
    const fs::path dir = fs::path(exe).parent_path();
    for (const fs::path& p : {dir / "launch", dir / ".." / "bin" / "launch"})
      if (executable(p)) return fs::weakly_canonical(p).string();
  }
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty() && executable(fs::path(d) / "launch")) return (fs::path(d) / "launch").string();
  }
  return "";
}

// A shell-readable rendering of argv for the line that says what runs.
std::string shell_words(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    const bool plain = !a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789-_./=:,+@%") == std::string::npos;
    std::string w = plain ? a : "'" + a + "'";
    if (!plain) {
      for (size_t i = 1; i + 1 < w.size(); ++i)
        if (w[i] == '\'') w.replace(i, 1, "'\\''"), i += 3;
    }
    out += (out.empty() ? "" : " ") + w;
  }
  return out;
}

}  // namespace

std::optional<std::vector<std::string>> self_launch_command(const TrainerOptions& t, const ProcessView& p) {
  const bool data_parallel = t.env_type == "pytorchDDP" || t.env_type == "deepspeed" || t.env_type == "deepspeed+mpu";
  const bool many = t.num_gpus > 1 || t.num_nodes > 0 || !t.hostfile.empty();
  if (!data_parallel || !many || p.under_launcher) return std::nullopt;
  const std::string launch = p.find_launch ? p.find_launch() : "";
  PT_INPUT_CHECK(!launch.empty(), "trainer.env_type ", t.env_type, " with ",
                 t.num_gpus > 1 ? cat("num_gpus ", t.num_gpus) : t.num_nodes > 0 ? cat("num_nodes ", t.num_nodes)
                                                                              : cat("hostfile ", t.hostfile),
                 " starts itself under `launch`, which is neither next to ", p.exe,
                 " nor on PATH (set POLYTRAIN_LAUNCH to its path, or run launch yourself)");
  std::vector<std::string> cmd{launch};
  if (!t.hostfile.empty()) cmd.insert(cmd.end(), {"--hostfile", t.hostfile});
  if (t.num_nodes > 0) cmd.insert(cmd.end(), {"--num_nodes", std::to_string(t.num_nodes)});
  if (t.num_gpus > 0) cmd.insert(cmd.end(), {"--num_gpus", std::to_string(t.num_gpus)});
  if (!t.master_ip.empty()) cmd.insert(cmd.end(), {"--master_addr", t.master_ip});
  if (t.master_port > 0) cmd.insert(cmd.end(), {"--master_port", std::to_string(t.master_port)});
  cmd.push_back("--");
  cmd.push_back(!t.training_script.empty() ? t.training_script : !p.exe.empty() ? p.exe : p.argv.at(0));
  if (p.argv.size() > 1) cmd.insert(cmd.end(), p.argv.begin() + 1, p.argv.end());
  return cmd;
}

TrainerOptions self_launch_options(const nlohmann::json& doc) {
  TrainerOptions t;
  const auto section = doc.find("trainer");
  if (section == doc.end() || !section->is_object()) return t;
  auto str = [&](const char* key, std::string& out) {
    if (auto it = section->find(key); it != section->end() && it->is_string()) out = it->get<std::string>();
  };
  auto num = [&](const char* key, int64_t& out) {
    if (auto it = section->find(key); it != section->end() && it->is_number_integer()) out = it->get<int64_t>();
  };
  str("env_type", t.env_type), str("hostfile", t.hostfile), str("training_script", t.training_script);
  str("master_addr", t.master_ip), str("master_ip", t.master_ip);
  num("num_gpus", t.num_gpus), num("num_nodes", t.num_nodes), num("master_port", t.master_port);
  return t;
}

ProcessView this_process() {
  ProcessView p;
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (size_t i = 0; i < raw.size();) {
    const size_t end = raw.find('\0', i);
    p.argv.push_back(raw.substr(i, end == std::string::npos ? std::string::npos : end - i));
    if (end == std::string::npos) break;
    i = end + 1;
  }
  std::error_code ec;
  p.exe = fs::read_symlink("/proc/self/exe", ec).string();
  p.under_launcher = read_dist_env().source != "none";
  const std::string exe = p.exe;
  p.find_launch = [exe] { return find_launch_for(exe); };
  return p;
}

void self_launch_if_asked(const TrainerOptions& t) {
  const auto cmd = self_launch_command(t, this_process());
  if (!cmd) return;
  std::printf("polytrain: env_type %s asks for more than one process and no launcher started this one: %s\n",
              t.env_type.c_str(), shell_words(*cmd).c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<char*> args;
  for (const auto& a : *cmd) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  throw InputError(cat("cannot start ", (*cmd)[0], ": ", std::strerror(errno)));
}

}  // namespace polytrain
