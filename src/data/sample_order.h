// Deterministic, portable randomness for the data pipeline: a counter-based SplitMix64
// generator, seed mixing, and the per-epoch sample permutation. Results are the same on every
// platform and standard library (no std::*_distribution, no torch RNG); who reads which part of
// the permuted stream (rank sharding) is left to the Trainer/backends.
#pragma once

#include <cstdint>
#include <vector>

namespace polytrain {

/// Hashes (seed, a, b, c) into one 64-bit key with SplitMix64 finalisers: changing any input
/// changes the key unpredictably. Used to key one generator per (seed, epoch, sample, ...).
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

/// Counter-based generator: draw k is splitmix64_finalise(key + (k+1) * golden_gamma), i.e.
/// SplitMix64 (Steele, Lea, Flood 2014) started at `key`. Cheap to create, so code keys a fresh
/// one per independent decision stream instead of sharing one sequential state.
class CounterRng {
 public:
  explicit CounterRng(uint64_t key) : key_(key) {}
  /// The next 64 uniform bits.
  uint64_t next_u64();
  /// Uniform double in [0, 1) with 53 random bits.
  double next_double();
  /// Unbiased uniform integer in [0, n), n >= 1 (rejection of the short top range).
  uint64_t bounded(uint64_t n);
  /// Draws consumed so far.
  uint64_t counter() const { return counter_; }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

/// A permutation of [0, n) that depends only on (seed, epoch): Fisher-Yates with unbiased
/// bounded integers from a CounterRng keyed on (seed, epoch).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace polytrain
