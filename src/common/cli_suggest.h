// An unknown command-line word as one line that names the nearest known flag: CLI11's own
// message ("The following arguments were not expected: 5 --max_step") gives no hint.
// Header-only and torch-free, because the training programs (libpolytrain) and `launch` (its
// own torch-free library) both use it.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "polytrain/common/nearest_name.h"

namespace polytrain::cli {

/// The long names (without dashes) of app's options a user may type: hidden ones (group "")
/// are internal and never suggested.
inline std::vector<std::string> visible_flags(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* opt : app.get_options())
    if (!opt->get_group().empty())
      for (const auto& name : opt->get_lnames()) out.push_back(name);
  return out;
}

/// One line for the first word of `extras` (what CLI11 could not place): an unknown flag with
/// the nearest known one, or a word that no flag takes.
inline std::string unknown_argument_message(const CLI::App& app, const std::vector<std::string>& extras) {
  if (extras.empty()) return "";
  const std::string& word = extras.front();
  const size_t start = word.find_first_not_of('-');
  if (start == 0 || start == std::string::npos)
    return "unexpected argument '" + word + "': no flag takes it (flags start with --; see --help)";
  const std::string shown = word.substr(0, word.find('='));  // --max_step=5 -> --max_step
  const std::string near = nearest_name(shown.substr(start), visible_flags(app), 4);
  if (near.empty()) return "unknown flag " + shown + " (see --help)";
  return "unknown flag " + shown + "; did you mean --" + near + "?";
}

}  // namespace polytrain::cli
