// Test helper: a network namespace a peer runs in, linked to this one by a veth pair (host_ip
// here, peer_ip there). With `block_inbound`, as a volunteer behind a NAT or a firewall: an
// nftables rule inside drops every packet that opens a flow (`ct state new`), so the peer
// connects out and gets its answers while nothing can connect or send to it first.
// limit_rate() shapes what flows into it (a slow link). Needs root (or CAP_NET_ADMIN), `ip` and
// `tc` (iproute2) and `nft` (nftables), which scripts/setup.sh installs; where it cannot be set
// up, `ok` is false and `why` names the command that failed; each test that uses it has a
// loopback form for that case that checks the same things (POLYTRAIN_TEST_NO_NETNS=1 forces it).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace polytrain::testing {

class PeerNamespace {
 public:
  std::string name, host_ip, peer_ip, why;
  bool ok = false;

  explicit PeerNamespace(bool block_inbound) {
    if (const char* no = std::getenv("POLYTRAIN_TEST_NO_NETNS"); no && std::string(no) == "1") {
      why = "POLYTRAIN_TEST_NO_NETNS=1";  // forces a test's loopback form on a machine that has namespaces
      return;
    }
    const int pid = static_cast<int>(::getpid());
    name = "pt_peer_" + std::to_string(pid);
    host_if_ = "pth" + std::to_string(pid);  // interface names: at most 15 characters
    const std::string peer_if = "ptc" + std::to_string(pid);
    // A /30 of 10.213.0.0/16 per process (16384 of them): tests running at once do not share one.
    const int slot = pid % 16384;
    const std::string net = "10.213." + std::to_string(slot / 64) + ".";
    host_ip = net + std::to_string(slot % 64 * 4 + 1);
    peer_ip = net + std::to_string(slot % 64 * 4 + 2);
    const std::string in = "ip netns exec " + name + " ";
    std::vector<std::string> steps = {
        "ip netns add " + name,
        "ip link add " + host_if_ + " type veth peer name " + peer_if,
        "ip link set " + peer_if + " netns " + name,
        "ip addr add " + host_ip + "/30 dev " + host_if_,
        "ip link set " + host_if_ + " up",
        in + "ip addr add " + peer_ip + "/30 dev " + peer_if,
        in + "ip link set " + peer_if + " up",
        in + "ip link set lo up",
    };
    if (block_inbound)
      steps.insert(steps.end(), {in + "nft add table inet polytrain",
                                 in + "nft 'add chain inet polytrain input { type filter hook input priority 0; policy accept; }'",
                                 in + "nft add rule inet polytrain input ct state new counter drop"});
    ok = run(steps);
  }

  /// Shapes the traffic into the namespace to `rate` (tc's units: "200mbit").
  bool limit_rate(const std::string& rate) {
    return run({"tc qdisc add dev " + host_if_ + " root tbf rate " + rate + " burst 256kb latency 400ms"});
  }

  /// Bytes sent into the namespace so far.
  long long bytes_in() const {
    std::ifstream in("/sys/class/net/" + host_if_ + "/statistics/tx_bytes");
    long long n = -1;
    in >> n;
    return n;
  }
  PeerNamespace(const PeerNamespace&) = delete;
  PeerNamespace& operator=(const PeerNamespace&) = delete;
  ~PeerNamespace() {
    if (!created_) return;
    std::system(("ip netns del " + name + " >/dev/null 2>&1").c_str());  // takes the veth pair with it
    std::system(("ip link del " + host_if_ + " >/dev/null 2>&1").c_str());
  }

  /// Prefix of a shell command that runs in the namespace.
  std::string exec() const { return "ip netns exec " + name + " "; }

  /// Inbound packets the rule dropped so far (-1 when it cannot be read).
  long long dropped() const {
    FILE* f = ::popen((exec() + "nft list chain inet polytrain input 2>/dev/null").c_str(), "r");
    if (!f) return -1;
    long long n = -1;
    char line[512];
    while (std::fgets(line, sizeof line, f))
      if (const char* p = std::strstr(line, "packets ")) n = std::atoll(p + 8);
    ::pclose(f);
    return n;
  }

  /// Whether a TCP connection from `from_inside` to a listener on the other side opens within
  /// `timeout_ms`: the listener is made by a thread that entered the namespace (setns acts on
  /// the calling thread only) or by this one.
  bool connects(bool from_inside, int timeout_ms = 1000) const {
    int listener = -1;
    auto listen_on = [&](const std::string& ip) {
      listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a = address(ip, 0);
      if (::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listener, 4) != 0) {
        ::close(listener);
        listener = -1;
      }
    };
    auto connect_to = [&](const std::string& ip, int port) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      sockaddr_in a = address(ip, port);
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      pollfd p{fd, POLLOUT, 0};
      int err = 1;
      socklen_t len = sizeof err;
      const bool open = ::poll(&p, 1, timeout_ms) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
      ::close(fd);
      return open;
    };
    auto in_namespace = [&](auto&& what) {
      std::thread t([&] {
        const int ns = ::open(("/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
        if (ns >= 0 && ::setns(ns, CLONE_NEWNET) == 0) what();
        if (ns >= 0) ::close(ns);
      });
      t.join();
    };
    bool open = false;
    if (from_inside) {
      listen_on(host_ip);
      if (listener >= 0) in_namespace([&] { open = connect_to(host_ip, port_of(listener)); });
    } else {
      in_namespace([&] { listen_on(peer_ip); });
      if (listener >= 0) open = connect_to(peer_ip, port_of(listener));
    }
    if (listener >= 0) ::close(listener);
    return open;
  }

 private:
  std::string host_if_;
  bool created_ = false;

  bool run(const std::vector<std::string>& steps) {
    for (const auto& s : steps) {
      if (std::system((s + " >/dev/null 2>&1").c_str()) != 0) {
        why = "'" + s + "' failed";
        return false;
      }
      created_ = true;
    }
    return true;
  }

  static sockaddr_in address(const std::string& ip, int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
    return a;
  }
  static int port_of(int fd) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    return ntohs(a.sin_port);
  }
};

}  // namespace polytrain::testing
