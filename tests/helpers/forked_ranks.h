// Forked ranks with a deadline, ended by pid (each rank a real process over Gloo on loopback).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "helpers/rank_process.h"

namespace polytrain::testing {

/// Forks `world` ranks running body(rank) (exit 0 = pass) and waits at most `deadline`;
/// ranks still running then are SIGKILLed by pid. Returns each rank's wait status.
template <class F>
std::vector<int> run_ranks(int world, std::chrono::seconds deadline, F body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) run_as_rank(r, body);
    pids.push_back(pid);
  }
  std::vector<int> status(world, -1);
  const auto end = std::chrono::steady_clock::now() + deadline;
  for (int left = world; left > 0;) {
    for (int r = 0; r < world; ++r) {
      if (status[r] != -1) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) status[r] = st, --left;
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      ADD_FAILURE() << "ranks still running after " << deadline.count() << " s: killed";
      for (int r = 0; r < world; ++r)
        if (status[r] == -1) ::kill(pids[r], SIGKILL);
      for (int r = 0; r < world; ++r)
        if (status[r] == -1) ::waitpid(pids[r], &status[r], 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status;
}

}  // namespace polytrain::testing
