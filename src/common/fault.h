// Fault injection for the multi-process tests: POLYTRAIN_FAULT="RANK:POINT[:HIT[:SIGNAL]]"
// makes the process of global rank RANK (the RANK variable; "*" = every rank) send itself
// SIGNAL (KILL, STOP, TERM, SEGV, ABRT; default KILL) the HIT-th time (default 1) it passes
// POINT, after saying so on stderr; several such specs separated by commas act independently.
// Points: "rendezvous" (before a communicator connects, and before a fault-tolerant regroup
// connects its new group), "allreduce" (a gradient bucket's all-reduce has been issued, the
// others not yet), "checkpoint" (one file of a checkpoint written, nothing committed), "eval"
// (one evaluation batch done), "step" (an optimizer step completed: HIT 5 is after the fifth
// step a run from step 0 takes), "join" (fault tolerance: the live state is about to go to a
// replacement for a lost rank). Armed in a group's first start only (not after launch
// --max_restarts restarts it, nor in a replacement it starts for a lost rank). Unset: fault_point() costs one branch. A malformed value is an
// InputError naming POLYTRAIN_FAULT.
#pragma once

namespace polytrain {

void fault_point(const char* point);

// Parses POLYTRAIN_FAULT now (run_main calls it first): a malformed value ends the program
// with exit code 2 before anything starts, not at the first fault point.
void check_fault_spec();

}  // namespace polytrain
