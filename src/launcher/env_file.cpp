#include "polytrain/launcher/env_file.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "polytrain/common/error.h"
#include "polytrain/launcher/hostfile.h"

namespace polytrain::launcher {
namespace {

using ::polytrain::detail::cat;

bool valid_key(const std::string& k) {
  if (k.empty() || std::isdigit(static_cast<unsigned char>(k[0]))) return false;
  for (unsigned char c : k)
    if (!std::isalnum(c) && c != '_') return false;
  return true;
}

}  // namespace

void set_env(EnvList& env, const std::string& key, const std::string& value) {
  for (auto& [k, v] : env) {
    if (k == key) {
      v = value;
      return;
    }
  }
  env.emplace_back(key, value);
}

EnvList parse_env_file(const std::string& text, const std::string& source) {
  EnvList env;
  for (auto [line_no, line] : content_lines(text)) {
    if (line.rfind("export ", 0) == 0) line = trim(line.substr(7));
    const auto eq = line.find('=');
    const std::string key = eq == std::string::npos ? line : trim(line.substr(0, eq));
    if (eq == std::string::npos || !valid_key(key)) {
      throw InputError(cat(source, ":", line_no, ": expected KEY=VALUE, got '", line, "'"));
    }
    std::string value = trim(line.substr(eq + 1));
    if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front()) {
      value = value.substr(1, value.size() - 2);
    }
    set_env(env, key, value);
  }
  return env;
}

EnvList load_env_files() {
  const char* name_env = std::getenv("DS_ENV_FILE");
  const std::string name = name_env && *name_env ? name_env : ".deepspeed_env";
  std::vector<std::string> paths;
  if (name[0] == '/') paths.push_back(name);  // an absolute DS_ENV_FILE, as os.path.join does
  else if (const char* home = std::getenv("HOME"); home && *home) paths.push_back(std::string(home) + "/" + name);
  if (name[0] != '/') paths.push_back("./" + name);
  EnvList env;
  for (const auto& p : paths) {
    std::ifstream f(p, std::ios::binary);
    if (!f) continue;
    std::ostringstream ss;
    ss << f.rdbuf();
    for (auto& [k, v] : parse_env_file(ss.str(), p)) set_env(env, k, v);
  }
  return env;
}

}  // namespace polytrain::launcher
