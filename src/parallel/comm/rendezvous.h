// What the c10d-based communicators (Gloo, NCCL) share: the TCPStore they meet through (rank
// 0 hosts it at MASTER_ADDR:MASTER_PORT, the others connect; failures name the rank and
// address) and the wait handle over a c10d::Work.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

c10::intrusive_ptr<c10d::Store> rendezvous_store(const std::string& engine, int rank, int size,
                                                 const std::string& addr, int port,
                                                 std::chrono::milliseconds timeout);

/// This rank's place in its colour's group when `comm` splits (MPI_Comm_split's order: by key,
/// then by old rank), from an all_gather of every rank's (colour, key) in a tensor on `device`.
struct SplitPlace {
  int rank;
  int size;
};
SplitPlace split_place(Communicator& comm, int color, int key, const c10::Device& device);

/// The first line of an exception's message (c10 errors append C++ stack traces).
std::string first_line(const std::exception& e);

/// A c10d::Work as a CommWork: wait() rethrows a failure as a CommFailure (comm_failure.h) naming `what` (the rank
/// and operation), then runs `then` (a fallback's finishing step). With `wait_on_destroy`, a
/// handle dropped unwaited still waits (Gloo writes into host buffers the caller may free).
class C10dWork : public CommWork {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string what, std::function<void()> then = {},
           bool wait_on_destroy = false);
  ~C10dWork() override;
  void wait() override;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  std::function<void()> then_;
  bool wait_on_destroy_;
};

}  // namespace polytrain
