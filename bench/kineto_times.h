// Kineto event times in nanoseconds whatever the LibTorch: startNs / durationNs in 2.x,
// startUs / durationUs (microseconds) in 1.x. For the benchmarks' profiles.
#pragma once

#include <cstdint>

namespace polytrain::bench {

template <typename E>
auto start_ns(const E& e, int) -> decltype(e.startNs()) {
  return e.startNs();
}
template <typename E>
uint64_t start_ns(const E& e, long) {
  return e.startUs() * 1000;
}
template <typename E>
auto duration_ns(const E& e, int) -> decltype(e.durationNs()) {
  return e.durationNs();
}
template <typename E>
uint64_t duration_ns(const E& e, long) {
  return e.durationUs() * 1000;
}

}  // namespace polytrain::bench
