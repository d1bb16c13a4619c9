// Test helper for the programs as a user runs them (train_gpt2, train_t5, ...): run a command
// from the source tree, numbers read back from the log, and the check that
// bad input gave exactly one `error:` line and exit code 2.
#pragma once

#include <gtest/gtest.h>

#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "helpers/process.h"

namespace polytrain::testing {

struct ProgramRun {
  int code;
  std::string out;  ///< stdout + stderr
};

/// `cmd` run from the source tree (where configs/ and .cache/assets/ are), stderr merged.
inline ProgramRun run_program(const std::string& cmd) {
  ProgramRun r{0, ""};
  r.code = run_command("cd " POLYTRAIN_SOURCE_DIR " && " + cmd + " 2>&1", &r.out);
  return r;
}

/// The numbers after `key ` in the order printed ("eval_loss 7.1", "| loss 8.2 |").
inline std::vector<double> numbers_after(const std::string& out, const std::string& key) {
  std::vector<double> v;
  const std::regex re(key + " ([0-9.]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) v.push_back(std::stod((*it)[1]));
  return v;
}

/// Exit code 2 and exactly one line starting "error: ", which contains `needle`.
inline void expect_one_line_error(const ProgramRun& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.out;
  int error_lines = 0;
  std::string last;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("error: ", 0) == 0) ++error_lines, last = line;
  EXPECT_EQ(error_lines, 1) << r.out;
  EXPECT_NE(last.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.out;
}

}  // namespace polytrain::testing
