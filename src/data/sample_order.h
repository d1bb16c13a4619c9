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

namespace polytrain {

/// Which samples one reader takes. Order and masking depend only on (seed, epoch, global
/// index), never on the number of readers:
///  - fixed world (DDP, ZeRO, tensor parallel): global batch `step` is positions
///    [step * B, (step + 1) * B) of the epoch's permutation (B = global batch); a micro-batch
///    of `size` samples per reader occupies a block of size * members positions starting
///    `offset` positions into the global batch, and reader `member` takes its member-th slice;
///  - own stream (a decentralized peer, no fixed world): the epoch permutation is cut into
///    blocks of `global_batch` positions (the peer's own batch) and stream `member` of
///    `members` is blocks member, member + members, ...; the reader walks it at its own pace
///    from a cursor (samples it has read), so distinct members never share a sample within an
///    epoch, and members reading one block each per global step read exactly the micro-batches
///    one process with micro-batch `global_batch` would read.
class SampleStream {
 public:
  struct Draw {
    std::vector<int64_t> indices;
    int64_t epoch = 0;
  };
  SampleStream(int64_t dataset_size, uint64_t seed, int64_t global_batch, int64_t member, int64_t members,
               bool own_stream);
  /// Fixed world: global batches per epoch (dataset_size / global_batch, the tail dropped).
  int64_t steps_per_epoch() const { return dataset_size_ / global_batch_; }
  /// This reader's samples of one micro-batch (fixed world: of global batch `step` at `offset`;
  /// own stream: the next `size` of its stream; step and offset unused).
  Draw next(int64_t step, int64_t offset, int64_t size);
  /// Own stream: samples read so far (saved with a checkpoint to resume the stream).
  int64_t cursor() const { return cursor_; }
  void set_cursor(int64_t c) { cursor_ = c; }

 private:
  const std::vector<int64_t>& order(int64_t epoch);

  int64_t dataset_size_, global_batch_, member_, members_;
  uint64_t seed_;
  bool own_stream_;
  int64_t cursor_ = 0;
  std::vector<int64_t> order_;
  int64_t order_epoch_ = -1;
};

}  // namespace polytrain
