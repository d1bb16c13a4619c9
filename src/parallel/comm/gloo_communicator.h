// Gloo through libtorch's c10d ProcessGroupGloo, rendezvous through a c10d TCPStore hosted
// by rank 0 at MASTER_ADDR:MASTER_PORT. The default CPU engine.
#pragma once

#include <memory>
#include <string>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

/// Rank `rank` of `size` meeting at addr:port (rank 0 hosts the store). Threads of one
/// process may each hold one (the tests run ranks as threads).
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int size, const std::string& addr, int port,
                                                     std::chrono::milliseconds timeout);

}  // namespace polytrain
