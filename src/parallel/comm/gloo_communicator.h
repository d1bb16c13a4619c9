// Gloo through libtorch's c10d ProcessGroupGloo, rendezvous through a c10d TCPStore hosted
// by rank 0 at MASTER_ADDR:MASTER_PORT. The default CPU engine.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

/// Rank `rank` of `size` meeting at addr:port (rank 0 hosts the store). Threads of one
/// process may each hold one (the tests run ranks as threads).
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int size, const std::string& addr, int port,
                                                     std::chrono::milliseconds timeout);

/// Fault tolerance: makes new Gloo groups over the rendezvous store `world` met through (same
/// device and timeout): group `name` (a fresh store prefix, one per membership generation) of
/// `size` ranks, this process being `rank`. Null when `world` is not a Gloo communicator.
using GlooGroupFactory = std::function<std::unique_ptr<Communicator>(const std::string& name, int rank, int size)>;
GlooGroupFactory gloo_group_factory(Communicator& world);

/// Fault tolerance's quorum: the rendezvous store's key/value calls, on the store `world` met
/// through (hosted by its rank 0's process). Empty functions when `world` is not Gloo's.
struct StoreOps {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<bool(const std::string& key)> has;
  /// Sets `key` to `value` unless it is set already; returns the value it holds.
  std::function<std::string(const std::string& key, const std::string& value)> set_once;
  std::function<std::string(const std::string& key)> get;
};
StoreOps gloo_store_ops(Communicator& world);

/// Fault tolerance's replacement for a lost rank: the rendezvous store at addr:port reached as a
/// client (no group is joined), with what gloo_group_factory and gloo_store_ops give a member.
struct GlooRendezvous {
  GlooGroupFactory new_group;
  StoreOps store;
};
GlooRendezvous gloo_rendezvous_client(int rank, int size, const std::string& addr, int port,
                                      std::chrono::milliseconds timeout);

}  // namespace polytrain
