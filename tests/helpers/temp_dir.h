// Test helper: a fresh scratch folder under the system temp dir, removed with everything in it
// when the test is done (kept, and named on stderr, with POLYTRAIN_KEEP_TEST_DIRS=1). Removal never throws (a daemon a test started may still be deleting
// its own files there); a leftover folder is the worst case.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace polytrain::testing {

struct TempDir {
  std::filesystem::path path;

  /// <temp dir>/<prefix>_XXXXXX (mkdtemp: unique across tests, processes and ctest -j).
  explicit TempDir(const std::string& prefix = "pt_test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw std::runtime_error("cannot create a temp dir " + tmpl + ": " + std::strerror(errno));
    path = tmpl;
  }
  ~TempDir() {
    if (const char* keep = ::getenv("POLYTRAIN_KEEP_TEST_DIRS"); keep && *keep && *keep != '0') {
      std::fprintf(stderr, "[temp dir] kept %s (POLYTRAIN_KEEP_TEST_DIRS)\n", path.c_str());
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// The folder, or `sub` inside it, as a string.
  std::string str(const std::string& sub = "") const { return (sub.empty() ? path : path / sub).string(); }

  /// Writes `text` to `name` inside the folder (bytes as given); returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return str(name);
  }
};

}  // namespace polytrain::testing
