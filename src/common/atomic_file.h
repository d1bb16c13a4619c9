// Whole-file I/O with crash safety: write to a temporary file beside the target, fsync,
// rename over it, fsync the directory, so a reader sees the old file or the new one, never
// a torn one. File formats (checkpoints, safetensors, configs) live with their owners.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

namespace polytrain {

/// Atomically replaces `path` with `bytes` (see atomic_write_file below).
void atomic_write_file(const std::string& path, const std::string& bytes);

/// Atomically replaces `path` with what `writer` streams: writes `path.tmp.<pid>` in the same
/// directory, flushes and fsyncs it, renames it over `path`, fsyncs the directory. On any
/// failure the temporary file is removed and `path` is left as it was; an exception thrown
/// by `writer` propagates unchanged, a system call that fails for want of space (ENOSPC,
/// EDQUOT, EFBIG) throws NoSpaceError (an InputError, disk_space.h), another failed call
/// InternalError naming the path and strerror. A missing directory throws InputError. The
/// new file gets mode 0666 & ~umask (an existing file's mode is not carried over).
void atomic_write_file(const std::string& path,
                       const std::function<void(std::ostream&)>& writer);

/// The whole content of `path`. InputError naming the file when it is missing, unreadable
/// or a directory.
std::string read_file(const std::string& path);

/// fsyncs a directory so that a rename or create inside it survives a crash. InputError if
/// it does not exist; filesystems that cannot fsync a directory (EINVAL) are accepted.
void fsync_dir(const std::string& dir);

/// The directory part of `path` ("." for a bare file name, "/" for a file in the root).
std::string parent_dir(const std::string& path);

}  // namespace polytrain
