// The check a member makes of a parameter round's result before it replaces its own values;
// no torch. What the reducers answered is compared, part by part, with the member's own copy:
// the backend (hivemind_backend.cpp) restores its own values where a part fails.
//
// Why per part: each part is one reducer's answer (butterfly.h), so a failing part names the
// reducer that sent it, and the honest reducers' parts are kept.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace polytrain::hivemind {

/// How far a parameter round's result may move a member's parameters: the L2 distance between a
/// part's average and the member's own values, relative to the own values' L2 norm. Honest
/// members hold the same parameters up to their local steps (far below this); the average of two
/// independent random initialisations is ~0.71 away. A poisoned part (a huge weight, a flipped
/// or scaled vector) is not.
constexpr double kMaxParameterDrift = 1.0;

class ParameterRoundCheck {
 public:
  /// `part_sizes`: the group's parts of the flat vector, in order (part_sizes() of butterfly.h).
  /// Distances count only the first `distance_prefix` elements (the parameters; optimizer
  /// statistics after them may legitimately differ by multiples across members), finiteness
  /// counts every element.
  ParameterRoundCheck(std::vector<size_t> part_sizes, size_t distance_prefix,
                      double max_relative = kMaxParameterDrift);
  /// Elements [offset, offset + n) of the flat vector: `average` as the round returned them,
  /// `own` as this member held them before the round.
  void add(size_t offset, const float* average, const float* own, size_t n);
  /// The parts whose answer must not replace the member's values (non-finite, or too far).
  std::vector<size_t> failed_parts() const;
  /// [begin, end) of part j in the flat vector.
  std::pair<size_t, size_t> part_range(size_t j) const;
  /// Why part j failed (empty when it did not): "not finite" or "moves ... by x of their norm".
  std::string why(size_t j) const;

 private:
  struct Part {
    size_t begin = 0, end = 0;
    bool finite = true;
    double diff2 = 0.0, own2 = 0.0;
    size_t measured = 0;
  };
  double relative(const Part& p) const;
  std::vector<Part> parts_;
  size_t prefix_;
  double max_relative_;
};

}  // namespace polytrain::hivemind
