// "Did you mean ...?": the known name nearest to a mistyped one, for config keys (config_keys)
// and command-line flags (cli_suggest). Header-only and torch-free: `launch` uses it too.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

namespace polytrain {

/// Levenshtein distance (insert, delete, substitute each cost 1).
inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// The known name nearest to `typed` (case-insensitive), or "" when none is near: at most a
/// third of the typed name changed (at least one edit allowed). A name that `typed` cuts short
/// ("output" for "output_path") counts as one edit when `typed` has `min_prefix` characters.
inline std::string nearest_name(const std::string& typed, const std::vector<std::string>& known,
                                size_t min_prefix) {
  auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  const std::string t = lower(typed);
  const std::string* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const auto& name : known) {
    size_t d = edit_distance(t, lower(name));
    if (t.size() >= min_prefix && lower(name).rfind(t, 0) == 0) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = &name;
  }
  if (!best || best_d > std::max<size_t>(1, t.size() / 3) || best_d >= t.size()) return "";
  return *best;
}

}  // namespace polytrain
