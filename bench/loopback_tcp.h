// The reference link of the hivemind benchmarks: one TCP stream over loopback with the swarm's
// own framed connections (1 MiB frames, memory to memory), in bytes per second.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "polytrain/swarm/wire.h"

/// CPU seconds (user + system, all threads) of this process so far.
inline double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

/// `bytes` (a multiple of 1 MiB) over one stream, in 1 MiB frames, from memory to memory: the
/// sender reads and the receiver writes through 64 MiB each (twice these VMs' L3), as a round
/// sends from and receives into a vector; one hot 1 MiB buffer at both ends would flatter the
/// link (the kernel would copy cache to cache). Timed until the receiver has it all.
/// `cores` (if given): the stream's CPU time over its wall time, both ends together.
inline double loopback_tcp_bandwidth_once(size_t bytes, double* cores = nullptr) {
  namespace hm = polytrain::hivemind;
  using namespace std::chrono_literals;
  constexpr size_t kFrame = size_t{1} << 20, kSpan = size_t{64} << 20;
  std::vector<char> from(kSpan, 'x'), into(kSpan, '\0');  // written beforehand: no page faults inside
  hm::Server sink("127.0.0.1:0", [&](hm::Connection& c) {
    try {
      hm::Frame other;
      for (size_t got = 0; got < bytes; got += kFrame)
        if (!c.receive_into(hm::after(10s), 1, nullptr, 0, into.data() + got % kSpan, kFrame, other, 0)) return;
      c.send(2, "", hm::after(10s));
    } catch (const hm::NetError&) {
    }
  });
  auto c = hm::Connection::connect(sink.address(), hm::after(5s));
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = process_cpu_seconds();
  for (size_t sent = 0; sent < bytes; sent += kFrame)
    c->send(1, {}, std::string_view(from.data() + sent % kSpan, kFrame), hm::after(10s));
  c->receive(hm::after(10s), 16);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (cores) *cores = (process_cpu_seconds() - cpu0) / s;
  return static_cast<double>(bytes) / s;
}

/// One stream's bandwidth is bimodal on these VMs (whether the two ends share a core): the best
/// of `reps` runs.
inline double loopback_tcp_bandwidth(size_t bytes, int reps = 3, double* cores = nullptr) {
  double best = 0;
  for (int i = 0; i < reps; ++i) {
    double busy = 0;
    const double bw = loopback_tcp_bandwidth_once(bytes, &busy);
    if (bw > best) {
      best = bw;
      if (cores) *cores = busy;
    }
  }
  return best;
}
