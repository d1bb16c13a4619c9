// Writes that fail for lack of space, told apart from other I/O errors so that their caller can
// say what the write needed and what the file system has: ENOSPC, EDQUOT, and EFBIG (past the
// process's file-size limit, RLIMIT_FSIZE, with SIGXFSZ ignored). atomic_write_file throws
// NoSpaceError for them; checkpoints turn it into a message with the bytes (checkpoint.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "polytrain/common/error.h"

namespace polytrain {

/// Bad input in the user's sense: free space, or write somewhere else. Exit code 2.
class NoSpaceError : public InputError {
 public:
  using InputError::InputError;
};

/// Whether errno `err` means the write ran out of space (ENOSPC, EDQUOT, EFBIG).
bool is_no_space_errno(int err);

/// Bytes an unprivileged writer can still use on the file system holding `path` (statvfs's
/// f_bavail x f_frsize); -1 when statvfs fails.
int64_t free_disk_bytes(const std::string& path);

}  // namespace polytrain
