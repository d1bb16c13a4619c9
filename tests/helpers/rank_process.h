// The body of one forked rank (gtest-free, so benches share it with the tests' run_ranks): one
// thread, body(rank) as the exit code, an exception printed as "rank R: what" and exit 1.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

#include <ATen/Parallel.h>

namespace polytrain::testing {

template <class F>
[[noreturn]] void run_as_rank(int rank, F body) {
  int rc = 1;
  try {
    ::setenv("OMP_NUM_THREADS", "1", 1);  // a Trainer built in body() keeps one thread too
    at::set_num_threads(1);
    rc = body(rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
  }
  std::fflush(nullptr);
  ::_exit(rc);
}

}  // namespace polytrain::testing
