// `launch --hold_pid PROGRAM [ARGS...]`: what mpirun starts for each rank, so that the pid
// mpirun knows stays allocated until mpirun itself is gone. Leaves to Open MPI everything
// else (placement, binding, output forwarding, PMIx).
//
// Why: when a rank fails, Open MPI 4.1's mpirun reaps it and then signals its pid again:
// SIGCONT at once, SIGTERM and SIGKILL a second later, each through getpgid(pid) ->
// kill(-pgrp), or kill(pid) when getpgid fails (orte/mca/odls/default, odls_default_kill_local).
// If another process has been given that pid meanwhile, it and its whole process group get
// those signals. A pid stays allocated while any process uses it as its process-group id, so:
//
//   mpirun/orted ── holder (pid H, leads group H; the pid mpirun knows)
//                    ├─ PROGRAM  (group H: mpirun's group signals reach it; its exit is the holder's)
//                    └─ keeper   (group H, ignores the catchable signals, no output; exits when
//                                 mpirun/orted does)
//
// After the holder exits and mpirun reaps it, getpgid(H) and kill(H) find no process H
// (ESRCH), and no other process can be given pid H while the keeper keeps group H alive.
#pragma once

#include <string>
#include <vector>

namespace polytrain::launcher {

/// Runs `argv` (looked up on PATH) as described above and exits as it did: with its exit
/// code, or killed by the same signal. Never returns.
[[noreturn]] void run_holding_pid(const std::vector<std::string>& argv);

}  // namespace polytrain::launcher
