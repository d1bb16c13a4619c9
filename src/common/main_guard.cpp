#include "polytrain/common/main_guard.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>

#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"

namespace polytrain {

namespace {
// One line: newlines inside a message would split the `error:` line (a carriage return too).
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::atomic<bool> g_failed{false};

int run_guarded(const std::function<int()>& body) {
  try {
    check_fault_spec();
    return body();
  } catch (const InputError& e) {
    // Several problems of one input (a config's errors, reported in one pass) come one per line.
    std::string what = e.what();
    for (size_t start = 0; start <= what.size();) {
      size_t end = what.find('\n', start);
      if (end == std::string::npos) end = what.size();
      const std::string line = one_line(what.substr(start, end - start));
      if (!line.empty()) std::fprintf(stderr, "error: %s\n", line.c_str());
      start = end + 1;
    }
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
}  // namespace

int run_main(const std::function<int()>& body) {
  const int rc = run_guarded(body);
  if (rc != 0) g_failed = true;
  return rc;
}

bool exiting_after_error() { return g_failed; }

}  // namespace polytrain
