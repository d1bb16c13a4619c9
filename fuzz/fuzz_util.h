// Shared by the fuzz targets (scripts/fuzz.sh builds them with clang -fsanitize=fuzzer).
// Contract of every parser of outside input: it returns a value or throws polytrain's
// InputError. Any other exception escapes LLVMFuzzerTestOneInput, and libFuzzer reports it as
// a crash, as it does memory errors (ASan), undefined behaviour (UBSan) and allocations over
// -malloc_limit_mb.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "polytrain/common/error.h"

namespace polytrain::fuzz {

// A file holding `bytes` for parsers that take a path: an in-memory file, named through /proc.
class MemFile {
 public:
  explicit MemFile(const std::string& bytes) : fd_(memfd_create("fuzz", 0)) {
    if (fd_ < 0) __builtin_trap();
    for (size_t off = 0; off < bytes.size();) {
      const ssize_t n = ::write(fd_, bytes.data() + off, bytes.size() - off);
      if (n <= 0) __builtin_trap();
      off += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

// Runs `f`, letting InputError (the contract's error) through silently.
template <class F>
void expect_value_or_input_error(F&& f) {
  try {
    f();
  } catch (const polytrain::InputError&) {
  }
}

}  // namespace polytrain::fuzz
