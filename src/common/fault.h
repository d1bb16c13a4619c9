// Fault injection for the multi-process tests: POLYTRAIN_FAULT="RANK:POINT[:HIT[:SIGNAL]]"
// makes the process of global rank RANK (the RANK variable; "*" = every rank) send itself
// SIGNAL (KILL, STOP, TERM, SEGV, ABRT; default KILL) the HIT-th time (default 1) it passes
// POINT, after saying so on stderr. Points: "rendezvous" (before a communicator connects),
// "allreduce" (a gradient bucket's all-reduce has been issued, the others not yet),
// "checkpoint" (one file of a checkpoint written, nothing committed), "eval" (one evaluation
// batch done). Unset: fault_point() costs one branch. A malformed value is an InputError
// naming POLYTRAIN_FAULT.
#pragma once

namespace polytrain {

void fault_point(const char* point);

// Parses POLYTRAIN_FAULT now (run_main calls it first): a malformed value ends the program
// with exit code 2 before anything starts, not at the first fault point.
void check_fault_spec();

}  // namespace polytrain
