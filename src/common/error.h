// Error types shared by every part of polytrain, and the CHECK macros.
// Library code throws; only a program's main() turns an exception into an exit code
// (see run_main in common/main_guard.h): InputError -> 2 with one `error: ...` line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace polytrain {

/// Base of every polytrain exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad user input: config file, CLI flag, data file, checkpoint. Exit code 2.
class InputError : public Error {
 public:
  using Error::Error;
};

/// An internal invariant failed (a bug, or a system call that failed). Exit code 1.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace polytrain

/// Throws InputError with the streamed message when cond is false.
#define PT_INPUT_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) throw ::polytrain::InputError(::polytrain::detail::cat(__VA_ARGS__)); \
  } while (0)

/// Throws InternalError naming file:line when cond is false.
#define PT_CHECK(cond, ...)                                                                  \
  do {                                                                                       \
    if (!(cond))                                                                             \
      throw ::polytrain::InternalError(::polytrain::detail::cat(                             \
          __FILE__, ":", __LINE__, ": check failed: " #cond ": ", ##__VA_ARGS__));           \
  } while (0)
