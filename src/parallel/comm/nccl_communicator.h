// NCCL through libtorch's c10d ProcessGroupNCCL (CUDA tensors). The NCCL unique id travels
// through the same c10d TCPStore rendezvous as Gloo's (MASTER_ADDR:MASTER_PORT). Built only
// when the libtorch found has CUDA (CMake: POLYTRAIN_WITH_NCCL).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

/// Rank `rank` of `size`, on the current CUDA device (set it before calling).
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, const std::string& addr, int port,
                                                     std::chrono::milliseconds timeout);

}  // namespace polytrain
