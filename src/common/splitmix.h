// SplitMix64 (java.util.SplittableRandom's constants): the finaliser and the golden-ratio
// increment of the counter-based streams (data order, dropout masks). Changing them changes
// every data order and mask, so they are fixed forever.
#pragma once

#include <cstdint>

namespace polytrain {

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;

/// SplitMix64's output function of the state z.
inline uint64_t splitmix_finalise(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace polytrain
