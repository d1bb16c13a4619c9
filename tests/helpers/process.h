// Test helper: run a shell command and get its exit code, collecting its stdout (and stderr
// when the command redirects it) or leaving the output to the test's own.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace polytrain::testing {

/// Exit code of `cmd` (-1 when it did not exit normally); its output is appended to *out.
inline int run_command(const std::string& cmd, std::string* out) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// Exit code of `cmd` (-1 when it did not exit normally); its output goes where the test's does.
inline int run_status(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace polytrain::testing
