// A bind probe for a TCP port, as a listener would bind it: used where a port in use must be
// named before a library tries it (the launcher's --master_port warning, rank 0's rendezvous
// check). Header-only and torch-free: `launch` uses it too.
#pragma once

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace polytrain {

/// errno of binding a TCP socket to host:port (SO_REUSEADDR, as c10d's listener sets it, so a
/// closed job's TIME_WAIT connections do not count), 0 when every address binds or host does
/// not resolve (the caller's own connection reports that). host nullptr: the wildcard
/// addresses, IPv4 and IPv6.
inline int tcp_bind_errno(const char* host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host, std::to_string(port).c_str(), &hints, &found) != 0) return 0;
  int err = 0;
  for (addrinfo* a = found; a != nullptr && err == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0) err = errno;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return err;
}

}  // namespace polytrain
