// Test helper: what a test needs from the machine (assets, a program on PATH, a Python module)
// and PT_SKIP_UNLESS, which skips a test whose need is missing, or, when the environment sets
// POLYTRAIN_REQUIRE_ALL=1 (scripts/test.sh does, for CI), fails it naming what is missing, so a
// set-up that missed a package cannot leave CI green. A test that needs a GPU uses plain
// GTEST_SKIP() << "needs CUDA": no set-up installs one.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "helpers/process.h"

namespace polytrain::testing {

/// True when POLYTRAIN_REQUIRE_ALL is "1": a missing tool, package or asset is a failure.
inline bool require_all() {
  const char* v = std::getenv("POLYTRAIN_REQUIRE_ALL");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

/// The folder scripts/fetch_assets.sh fills: $POLYTRAIN_CACHE, else <source>/.cache/assets.
inline std::string asset_cache() {
  const char* env = std::getenv("POLYTRAIN_CACHE");
  return env != nullptr && *env != '\0' ? env : std::string(POLYTRAIN_SOURCE_DIR) + "/.cache/assets";
}

/// True when `name` is a program on PATH.
inline bool have_command(const std::string& name) {
  std::string out;
  return run_command("command -v '" + name + "' > /dev/null 2>&1", &out) == 0;
}

/// True when /usr/bin/python3 (Debian's, whose python3-* packages the tests use) imports `module`.
inline bool python_imports(const std::string& module) {
  std::string out;
  return ::access("/usr/bin/python3", X_OK) == 0 &&
         run_command("/usr/bin/python3 -c 'import " + module + "' > /dev/null 2>&1", &out) == 0;
}

}  // namespace polytrain::testing

/// Unless `cond` holds: skip the test, or under POLYTRAIN_REQUIRE_ALL=1 fail it. `what` (streamed,
/// so `path + " ..."` or `a << b` both work) names what is missing and what provides it: the
/// Debian package, or scripts/fetch_assets.sh. Returns from the enclosing void function (a test
/// body, SetUp, or a helper the test calls), as GTEST_SKIP does.
#define PT_SKIP_UNLESS(cond, what)                                                                 \
  switch (0)                                                                                       \
  case 0:                                                                                          \
  default:                                                                                         \
    if (cond) {                                                                                    \
    } else if (::polytrain::testing::require_all())                                                \
      GTEST_FAIL() << "missing: " << what << " (a failure because POLYTRAIN_REQUIRE_ALL=1)";         \
    else                                                                                           \
      GTEST_SKIP() << "missing: " << what << " (set POLYTRAIN_REQUIRE_ALL=1 to fail instead)"
