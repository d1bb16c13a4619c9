// Kineto event times in nanoseconds whatever the LibTorch: startNs / durationNs in 2.x,
// startUs / durationUs (microseconds) in 1.x, and the CPU benchmarks' table of self times per op.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// Self time per op name (an op's time less its nested ops' on the same thread), ms per step.
template <typename Events>
void print_self_times(const Events& events, int steps, bool shapes) {
  std::map<uint64_t, std::vector<std::tuple<uint64_t, uint64_t, std::string>>> by_thread;
  for (const auto& e : events) {
    const uint64_t s = start_ns(e, 0);
    std::string key = e.name();
    for (const auto& shape : shapes ? e.shapes() : decltype(e.shapes()){}) {
      key += " [";
      for (size_t i = 0; i < shape.size(); ++i) key += (i ? "," : "") + std::to_string(shape[i]);
      key += "]";
    }
    for (const auto& d : shapes ? e.dtypes() : decltype(e.dtypes()){}) key += " " + d;
    by_thread[e.startThreadId()].emplace_back(s, s + duration_ns(e, 0), key);
  }
  std::map<std::string, double> self;
  double total = 0;
  for (auto& [tid, ev] : by_thread) {
    std::sort(ev.begin(), ev.end(), [](const auto& a, const auto& b) {
      return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) < std::get<0>(b) : std::get<1>(a) > std::get<1>(b);
    });
    std::vector<size_t> stack;
    std::vector<double> own(ev.size());
    for (size_t i = 0; i < ev.size(); ++i) {
      const auto [s, e, name] = ev[i];
      while (!stack.empty() && std::get<1>(ev[stack.back()]) <= s) stack.pop_back();
      own[i] = (e - s) / 1e6;
      if (!stack.empty()) own[stack.back()] -= own[i];
      else total += own[i];
      stack.push_back(i);
    }
    for (size_t i = 0; i < ev.size(); ++i) self[std::get<2>(ev[i])] += own[i];
  }
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [k, ms] : self) rows.emplace_back(ms, k);
  std::sort(rows.rbegin(), rows.rend());
  std::printf("profiled_ms_per_step %.1f\n", total / steps);
  for (size_t i = 0; i < rows.size() && i < (shapes ? 60u : 30u); ++i)
    std::printf("self %9.2f ms/step  %s\n", rows[i].first / steps, rows[i].second.c_str());
}

}  // namespace polytrain::bench
