// Whether the rendezvous port is free on this machine before the ranks are started: rank 0 binds
// it (Gloo's and NCCL's TCP store), and a port another job holds otherwise surfaces as a rank's
// "Address already in use" after the group has started, without naming the flag that moves it.
#pragma once

#include <string>

namespace polytrain::launcher {

/// True when nothing on this machine listens on TCP `port` (any address, IPv4 or IPv6).
bool tcp_port_free(int port);

/// The launcher's one-line warning for a busy --master_port, or "" when `port` is free.
std::string master_port_warning(int port);

}  // namespace polytrain::launcher
