// A bind probe for --master_port (port_check.h): only a listener counts as busy (tcp_port.h).
#include "polytrain/launcher/port_check.h"

#include <cerrno>

#include "polytrain/common/tcp_port.h"

namespace polytrain::launcher {

bool tcp_port_free(int port) {
  if (port <= 0 || port > 65535) return true;  // nothing to probe; the ranks report it
  return tcp_bind_errno(nullptr, port) != EADDRINUSE;
}

std::string master_port_warning(int port) {
  if (tcp_port_free(port)) return "";
  return "launch: warning: --master_port " + std::to_string(port) +
         ": address in use on this machine (another job's rendezvous?); ranks that meet over TCP (gloo, nccl) "
         "will fail: give a free port with --master_port";
}

}  // namespace polytrain::launcher
