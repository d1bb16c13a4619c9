#include "polytrain/swarm/round_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace polytrain::hivemind {

ParameterRoundCheck::ParameterRoundCheck(std::vector<size_t> part_sizes, size_t distance_prefix, double max_relative)
    : prefix_(distance_prefix), max_relative_(max_relative) {
  size_t at = 0;
  for (size_t n : part_sizes) {
    Part p;
    p.begin = at, p.end = at + n;
    parts_.push_back(p);
    at += n;
  }
}

void ParameterRoundCheck::add(size_t offset, const float* average, const float* own, size_t n) {
  const size_t end = offset + n;
  for (auto& p : parts_) {
    const size_t lo = std::max(p.begin, offset), hi = std::min(p.end, end);
    for (size_t i = lo; i < hi; ++i) {
      const double a = average[i - offset], o = own[i - offset];
      if (!std::isfinite(a)) p.finite = false;
      if (i >= prefix_) continue;
      p.diff2 += (a - o) * (a - o);
      p.own2 += o * o;
      ++p.measured;
    }
  }
}

double ParameterRoundCheck::relative(const Part& p) const {
  // An all-zero slice (fresh biases) is not divided by: it may move by 1e-3 per element (RMS).
  const double floor2 = 1e-6 * static_cast<double>(p.measured);
  return std::sqrt(p.diff2 / std::max(p.own2, floor2));
}

std::vector<size_t> ParameterRoundCheck::failed_parts() const {
  std::vector<size_t> out;
  for (size_t j = 0; j < parts_.size(); ++j)
    if (!why(j).empty()) out.push_back(j);
  return out;
}

std::pair<size_t, size_t> ParameterRoundCheck::part_range(size_t j) const { return {parts_[j].begin, parts_[j].end}; }

std::string ParameterRoundCheck::why(size_t j) const {
  const Part& p = parts_[j];
  if (!p.finite || !std::isfinite(p.diff2)) return "not finite";
  const double r = relative(p);
  if (p.measured == 0 || r <= max_relative_) return "";
  char buf[160];
  std::snprintf(buf, sizeof buf, "moves this peer's parameters by %.3g of their norm (at most %.3g)", r, max_relative_);
  return buf;
}

}  // namespace polytrain::hivemind
