// Robust aggregation for a reducer's part (issue 38): CenteredClip and the record of members
// that sent poison. No torch, no sockets: butterfly.cpp calls these on the contributions of
// one part; matchmaking asks the record whom to keep out of later groups.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace polytrain::hivemind {

/// How a reducer combines the contributions to its part (hivemind.aggregation).
enum class Aggregation { kMean, kCenteredClip };
/// InputError naming hivemind.aggregation for anything but "mean" or "centered_clip".
Aggregation parse_aggregation(const std::string& name);

struct Contribution {
  double weight = 0.0;  ///< samples behind it (> 0)
  const float* values = nullptr;
};

struct CenteredClipResult {
  /// Per contribution: min(1, tau / ||x_i - v||) of the last iteration (1: not clipped).
  std::vector<double> kept;
  int iterations = 0;  ///< run before v stopped moving (no contribution clipped) or the limit
};

/// CenteredClip (Karimireddy, He, Jaggi 2021, as "Secure Distributed Training at Scale",
/// Gorbunov et al. 2022, runs it per part): from the coordinate-wise median v,
///   v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i,   clip(z, tau) = z min(1, tau / ||z||),
/// `iterations` times, weighted by samples as the mean is. An iteration that clips nobody
/// makes v the weighted mean, summed in the order of `in` as butterfly's mean is (the same
/// bits), and ends the loop. Writes v to out[0..n) (`out` may be one of the inputs).
CenteredClipResult centered_clip(const std::vector<Contribution>& in, size_t n, double tau, int iterations, float* out);

/// Offences of the members of this peer's groups (non-finite values, a weight out of bounds, a
/// contribution mostly clipped away): after `ban_after` of them a peer id is banned for the rest
/// of the run: its contributions are ignored, it reduces nothing for this peer, and this peer's
/// matchmaking neither accepts nor joins it. Thread-safe.
class Offences {
 public:
  explicit Offences(int ban_after = 3) : ban_after_(ban_after) {}
  /// Counts one offence; true when this one bans the peer.
  bool record(const std::string& peer_id);
  bool banned(const std::string& peer_id) const;
  int count(const std::string& peer_id) const;

 private:
  int ban_after_;
  mutable std::mutex mu_;
  std::map<std::string, int> counts_;
};

}  // namespace polytrain::hivemind
