// The reference link of the hivemind benchmarks: one TCP stream over loopback with the swarm's
// own framed connections (1 MiB frames, the receiver discarding), in bytes per second.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>

#include "polytrain/parallel/hivemind/wire.h"

inline double loopback_tcp_bandwidth_once(size_t bytes) {
  namespace hm = polytrain::hivemind;
  using namespace std::chrono_literals;
  hm::Server sink("127.0.0.1:0", [](hm::Connection& c) {
    try {
      for (;;) c.receive(hm::after(10s), size_t{4} << 20);
    } catch (const hm::NetError&) {
    }
  });
  auto c = hm::Connection::connect(sink.address(), hm::after(5s));
  const std::string frame(size_t{1} << 20, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t sent = 0; sent < bytes; sent += frame.size()) c->send(1, frame, hm::after(10s));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(bytes) / s;
}

/// One stream's bandwidth is bimodal on these VMs (whether the two ends share a core): the best
/// of `reps` runs.
inline double loopback_tcp_bandwidth(size_t bytes, int reps = 3) {
  double best = 0;
  for (int i = 0; i < reps; ++i) best = std::max(best, loopback_tcp_bandwidth_once(bytes));
  return best;
}
