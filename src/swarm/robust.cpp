#include "polytrain/swarm/robust.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "polytrain/common/error.h"

namespace polytrain::hivemind {
namespace {

// Coordinate-wise median (the mean of the two middle values for an even count): the start of
// CenteredClip, which a minority of outliers cannot move far.
void coordinate_median(const std::vector<Contribution>& in, size_t n, double* v) {
  std::vector<double> column(in.size());
  const size_t k = in.size(), mid = k / 2;
  for (size_t e = 0; e < n; ++e) {
    for (size_t i = 0; i < k; ++i) column[i] = static_cast<double>(in[i].values[e]);
    std::nth_element(column.begin(), column.begin() + mid, column.end());
    double m = column[mid];
    if (k % 2 == 0) m = 0.5 * (m + *std::max_element(column.begin(), column.begin() + mid));
    v[e] = m;
  }
}

double distance(const float* x, const double* v, size_t n) {
  double s = 0.0;
  for (size_t e = 0; e < n; ++e) {
    const double d = static_cast<double>(x[e]) - v[e];
    s += d * d;
  }
  return std::sqrt(s);
}

// The weighted mean in the order of `in`, as butterfly's weighted_mean sums it (same bits).
void weighted_mean_into(const std::vector<Contribution>& in, size_t n, double total, double* v) {
  for (size_t e = 0; e < n; ++e) {
    double acc = in[0].weight * static_cast<double>(in[0].values[e]);
    for (size_t i = 1; i < in.size(); ++i) acc += in[i].weight * static_cast<double>(in[i].values[e]);
    v[e] = acc / total;
  }
}

}  // namespace

Aggregation parse_aggregation(const std::string& name) {
  if (name == "mean") return Aggregation::kMean;
  if (name == "centered_clip") return Aggregation::kCenteredClip;
  throw InputError("hivemind.aggregation '" + name + "': expected mean or centered_clip");
}

CenteredClipResult centered_clip(const std::vector<Contribution>& in, size_t n, double tau, int iterations, float* out) {
  PT_CHECK(!in.empty() && tau > 0 && iterations >= 1, "centered_clip: ", in.size(), " inputs, tau ", tau);
  CenteredClipResult res;
  res.kept.assign(in.size(), 1.0);
  double total = 0.0;
  for (const auto& c : in) total += c.weight;
  PT_CHECK(total > 0, "centered_clip: no weight");
  std::unique_ptr<double[]> v(new double[std::max<size_t>(n, 1)]);
  coordinate_median(in, n, v.get());
  std::vector<double> scale(in.size());  // w_i min(1, tau / ||x_i - v||) / W
  for (int it = 0; it < iterations; ++it) {
    ++res.iterations;
    bool clipped = false;
    for (size_t i = 0; i < in.size(); ++i) {
      const double d = distance(in[i].values, v.get(), n);
      res.kept[i] = d > tau ? tau / d : 1.0;
      clipped = clipped || d > tau;
      scale[i] = in[i].weight * res.kept[i] / total;
    }
    if (!clipped) {  // v + mean_i(x_i - v) is the mean itself: take it exactly, and stop
      weighted_mean_into(in, n, total, v.get());
      break;
    }
    for (size_t e = 0; e < n; ++e) {
      const double ve = v[e];
      double step = 0.0;
      for (size_t i = 0; i < in.size(); ++i) step += scale[i] * (static_cast<double>(in[i].values[e]) - ve);
      v[e] = ve + step;
    }
  }
  for (size_t e = 0; e < n; ++e) out[e] = static_cast<float>(v[e]);
  return res;
}

bool Offences::record(const std::string& peer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  return ++counts_[peer_id] == ban_after_;
}

bool Offences::banned(const std::string& peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(peer_id);
  return it != counts_.end() && it->second >= ban_after_;
}

int Offences::count(const std::string& peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(peer_id);
  return it == counts_.end() ? 0 : it->second;
}

}  // namespace polytrain::hivemind
