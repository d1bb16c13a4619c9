// atomic_write_file / read_file / fsync_dir over POSIX calls: the temp file is written
// through a small fd-backed streambuf so that the same descriptor can be fsynced, which
// std::ofstream cannot do. Linux/POSIX only.
#include "polytrain/common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ostream>
#include <streambuf>
#include <vector>

#include "polytrain/common/disk_space.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

// A full disk (or quota, or file-size limit) is the user's to fix: NoSpaceError, which callers
// that know what the write needed extend; anything else is an InternalError.
[[noreturn]] void throw_sys(const std::string& what, const std::string& path, int err) {
  const std::string msg = detail::cat(what, " ", path, ": ", errno_text(err));
  if (is_no_space_errno(err)) throw NoSpaceError(msg);
  throw InternalError(msg);
}

// Writes everything or returns the errno of the failure (0 on success); retries EINTR and
// short writes.
int write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}

// An output streambuf over a file descriptor that remembers the first write error, so the
// caller can report strerror rather than just "stream failed".
class FdStreambuf : public std::streambuf {
 public:
  explicit FdStreambuf(int fd) : fd_(fd), buffer_(1 << 16) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  int error() const { return error_; }

 protected:
  int_type overflow(int_type ch) override {
    if (flush_buffer() != 0) return traits_type::eof();
    if (!traits_type::eq_int_type(ch, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(ch);
      pbump(1);
    }
    return traits_type::not_eof(ch);
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    // Large writes bypass the buffer.
    if (n >= static_cast<std::streamsize>(buffer_.size())) {
      if (flush_buffer() != 0) return 0;
      if (int err = write_all(fd_, s, static_cast<size_t>(n))) {
        error_ = err;
        return 0;
      }
      return n;
    }
    return std::streambuf::xsputn(s, n);
  }
  int sync() override { return flush_buffer() == 0 ? 0 : -1; }

 private:
  int flush_buffer() {
    if (error_ != 0) return error_;
    size_t n = static_cast<size_t>(pptr() - pbase());
    if (n > 0) error_ = write_all(fd_, pbase(), n);
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return error_;
  }

  int fd_;
  std::vector<char> buffer_;
  int error_ = 0;
};

bool is_directory(const std::string& dir) {
  struct stat st;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

bool is_no_space_errno(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

int64_t free_disk_bytes(const std::string& path) {
  struct statvfs st;
  if (::statvfs(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR)
      throw InputError(detail::cat("directory ", dir, " does not exist: ", errno_text(err)));
    throw_sys("cannot open directory", dir, err);
  }
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw_sys("cannot fsync directory", dir, err);
}

void atomic_write_file(const std::string& path,
                       const std::function<void(std::ostream&)>& writer) {
  const std::string dir = parent_dir(path);
  PT_INPUT_CHECK(is_directory(dir), "cannot write ", path, ": directory ", dir,
                 " does not exist or is not a directory");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) throw_sys("cannot create", tmp, errno);
  try {
    {
      FdStreambuf buf(fd);
      std::ostream os(&buf);
      writer(os);
      os.flush();
      if (buf.error() != 0) throw_sys("cannot write", tmp, buf.error());
      PT_CHECK(os.good(), "stream writing ", tmp, " went bad");
    }
    int rc;
    do rc = ::fsync(fd);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) throw_sys("cannot fsync", tmp, errno);
    int closed = ::close(fd);
    fd = -1;
    if (closed != 0) throw_sys("cannot close", tmp, errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw_sys(detail::cat("cannot rename ", tmp, " to"), path, errno);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The new name is in place; make it durable. A failure here still leaves a whole file.
  fsync_dir(dir);
}

void atomic_write_file(const std::string& path, const std::string& bytes) {
  atomic_write_file(path, [&bytes](std::ostream& os) {
    os.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  });
}

std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    throw InputError(detail::cat("cannot read ", path, ": ", errno_text(err)));
  }
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      throw InputError(detail::cat("cannot read ", path, ": is a directory"));
    }
    if (st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  }
  char chunk[1 << 16];
  for (;;) {
    ssize_t r = ::read(fd, chunk, sizeof chunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw InputError(detail::cat("cannot read ", path, ": ", errno_text(err)));
    }
    if (r == 0) break;
    out.append(chunk, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

}  // namespace polytrain
