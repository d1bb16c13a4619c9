// Repeated rank errors folded into one console line and a note (repeated_errors.h).
#include "polytrain/launcher/repeated_errors.h"

#include <algorithm>

namespace polytrain::launcher {

std::string rank_ranges(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

bool RepeatedErrors::show(const std::string& line, int rank) {
  if (line.rfind("error: ", 0) != 0) return true;
  for (auto& s : seen_) {
    if (s.line != line) continue;
    if (rank != s.first_rank) s.repeats.push_back(rank);
    return false;
  }
  seen_.push_back({line, rank, {}});
  return true;
}

bool RepeatedErrors::shown(const std::string& line) const {
  return std::any_of(seen_.begin(), seen_.end(), [&](const Seen& s) { return s.line == line; });
}

std::vector<std::string> RepeatedErrors::notes() const {
  std::vector<std::string> out;
  for (const auto& s : seen_)
    if (!s.repeats.empty())
      out.push_back("(same error as rank " + std::to_string(s.first_rank) + " on " + rank_ranges(s.repeats) + ")");
  return out;
}

}  // namespace polytrain::launcher
