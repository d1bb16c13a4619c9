// Where a config's file paths point, and the parse that reports unreadable input files with the
// config's other errors. The rule (docs/config.md, "Paths"): a relative input path in a config
// FILE is looked up in the file's folder, then in the current directory; one given on the command
// line, and every output folder, is the current directory's. Parsing itself is config.cpp's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace polytrain {

/// Readies a run's config sources before build_config merges them: in `file_doc` (the config
/// file's JSON, read from `config_path`; {} and "" without one) FlagAI's trainer names are moved to
/// their DeepSpeed keys, and each relative input path that `overrides` does not replace is
/// rewritten to where it was found (`<config folder>/path`, else `path` in the current directory).
/// Returns one message per input file that cannot be read (the key with its index, the path, the
/// folders looked in), those of `overrides` included, for config_from_json_with to report.
std::vector<std::string> prepare_config_sources(nlohmann::json& file_doc, const std::string& config_path,
                                                const nlohmann::json& overrides);

/// config_from_json, reporting `earlier` (e.g. prepare_config_sources' messages) with the
/// parser's own errors in one InputError: one error per line, each once, each prefixed by origin.
Config config_from_json_with(const nlohmann::json& doc, const std::string& origin, int64_t world_size,
                             std::vector<std::string> earlier);

}  // namespace polytrain
