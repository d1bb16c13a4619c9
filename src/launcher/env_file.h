// DeepSpeed's .deepspeed_env: KEY=VALUE lines exported to every worker (local and remote).
// Read from ~/ then ./ (later wins), or the file named by DS_ENV_FILE; blank lines and '#'
// comments are skipped (DeepSpeed crashes on a blank line); anything else is an error.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace polytrain::launcher {

using EnvList = std::vector<std::pair<std::string, std::string>>;

/// Parses KEY=VALUE lines; an optional leading "export " is accepted, surrounding quotes of
/// the value are removed. Errors name `source` and the line.
EnvList parse_env_file(const std::string& text, const std::string& source);

/// The exports for a launch: ~/.deepspeed_env then ./.deepspeed_env (or $DS_ENV_FILE's name
/// in those two places), later files overriding earlier keys. Missing files are skipped.
EnvList load_env_files();

/// Sets or replaces `key` in `env`.
void set_env(EnvList& env, const std::string& key, const std::string& value);

}  // namespace polytrain::launcher
