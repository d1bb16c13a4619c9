// The one place where exceptions become exit codes: every program's main() calls run_main.
// InputError (bad config, flag, data file, checkpoint) -> `error: ...` on stderr, exit 2;
// any other exception -> `error: ...`, exit 1. Never a stack trace for a user mistake.
#pragma once

#include <functional>

namespace polytrain {

/// Runs body() and maps exceptions to exit codes as described above.
int run_main(const std::function<int()>& body);

/// True once run_main's body failed (threw or returned non-zero): exit-time clean-ups that wait
/// for the other ranks (MPI_Finalize's barrier) skip themselves, so a failing rank ends at once
/// and its launcher stops the rest instead of every rank waiting for the one that left.
bool exiting_after_error();

}  // namespace polytrain
