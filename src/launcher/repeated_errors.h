// The console shows each distinct `error: ...` line of the ranks once: ranks that fail on the
// same input (a config every rank reads) print the same line, and N copies of it bury the
// report. Only the console is spared; the rank logs and each rank's tail keep every line.
#pragma once

#include <string>
#include <vector>

namespace polytrain::launcher {

/// "rank 3", "ranks 0-2", "ranks 0-2, 5, 7-8": ascending, runs collapsed, repeats dropped.
std::string rank_ranges(std::vector<int> ranks);

/// The `error: ` lines the ranks printed, by text, and which ranks repeated each.
class RepeatedErrors {
 public:
  /// Whether the console shows `line` (a rank's line without its prefix): any line that is not
  /// an error line, and an error line the first time it comes; a repeat is counted for `rank`.
  bool show(const std::string& line, int rank);
  /// Whether `line` is an error line the console has shown (a report need not repeat it).
  bool shown(const std::string& line) const;
  /// One "(same error as rank R on ranks ...)" per error line that other ranks repeated.
  std::vector<std::string> notes() const;

 private:
  struct Seen {
    std::string line;
    int first_rank;
    std::vector<int> repeats;
  };
  std::vector<Seen> seen_;
};

}  // namespace polytrain::launcher
