// A bind probe for --master_port (port_check.h). SO_REUSEADDR, as the TCP stores set it, so a
// port left in TIME_WAIT by the previous run counts as free and only a listener counts as busy.
#include "polytrain/launcher/port_check.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace polytrain::launcher {

bool tcp_port_free(int port) {
  if (port <= 0 || port > 65535) return true;  // nothing to probe; the ranks report it
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return true;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool busy = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return !busy;
}

std::string master_port_warning(int port) {
  if (tcp_port_free(port)) return "";
  return "launch: warning: --master_port " + std::to_string(port) +
         ": address in use on this machine (another job's rendezvous?); ranks that meet over TCP (gloo, nccl) "
         "will fail: give a free port with --master_port";
}

}  // namespace polytrain::launcher
