// The one place where exceptions become exit codes: every program's main() calls run_main.
// InputError (bad config, flag, data file, checkpoint) -> `error: ...` on stderr, exit 2;
// any other exception -> `error: ...`, exit 1. Never a stack trace for a user mistake.
#pragma once

#include <functional>

namespace polytrain {

/// Runs body() and maps exceptions to exit codes as described above.
int run_main(const std::function<int()>& body);

}  // namespace polytrain
