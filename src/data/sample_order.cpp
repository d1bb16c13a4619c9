// SplitMix64-based counter RNG, seed mixing and the epoch permutation (see sample_order.h).
#include "polytrain/data/sample_order.h"

#include <utility>

#include "polytrain/common/error.h"
#include "polytrain/common/splitmix.h"

namespace polytrain {
namespace {

// Domain tag so permutation keys never coincide with keys built by other users of mix_seed.
constexpr uint64_t kPermutationDomain = 0x7065726D75746531ULL;  // "permute1"

}  // namespace

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  // Each input is absorbed by one full SplitMix64 round, so (a, b) and (b, a) differ.
  uint64_t h = splitmix_finalise(seed + kGoldenGamma);
  h = splitmix_finalise(h ^ (a + 1 * kGoldenGamma));
  h = splitmix_finalise(h ^ (b + 2 * kGoldenGamma));
  h = splitmix_finalise(h ^ (c + 3 * kGoldenGamma));
  return h;
}

uint64_t CounterRng::next_u64() {
  ++counter_;
  return splitmix_finalise(key_ + counter_ * kGoldenGamma);
}

double CounterRng::next_double() {
  return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

uint64_t CounterRng::bounded(uint64_t n) {
  PT_CHECK(n >= 1, "bounded(0)");
  // Values below `threshold` = 2^64 mod n would make the low residues more likely; reject them.
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t r = next_u64();
    if (r >= threshold) return r % n;
  }
}

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  PT_CHECK(n >= 0, "negative permutation size ", n);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  CounterRng rng(mix_seed(seed, static_cast<uint64_t>(epoch), 0, kPermutationDomain));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.bounded(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

}  // namespace polytrain

namespace polytrain {

SampleStream::SampleStream(int64_t dataset_size, uint64_t seed, int64_t global_batch, int64_t member,
                           int64_t members, bool own_stream)
    : dataset_size_(dataset_size), global_batch_(global_batch), member_(member), members_(members), seed_(seed),
      own_stream_(own_stream) {
  PT_CHECK(members >= 1 && member >= 0 && member < members, "reader ", member, " of ", members);
  PT_CHECK(global_batch >= 1, "global batch ", global_batch);
}

const std::vector<int64_t>& SampleStream::order(int64_t epoch) {
  if (epoch != order_epoch_) {
    order_ = epoch_permutation(dataset_size_, seed_, epoch);
    order_epoch_ = epoch;
  }
  return order_;
}

SampleStream::Draw SampleStream::next(int64_t step, int64_t offset, int64_t size) {
  Draw d;
  if (!own_stream_) {
    const int64_t per_epoch = steps_per_epoch();
    PT_CHECK(per_epoch > 0, "fewer samples (", dataset_size_, ") than one global batch (", global_batch_, ")");
    d.epoch = step / per_epoch;
    const int64_t start = (step % per_epoch) * global_batch_ + offset + member_ * size;
    PT_CHECK(offset + members_ * size <= global_batch_, "micro-batch at ", offset, " overruns the global batch");
    const auto& o = order(d.epoch);
    d.indices.assign(o.begin() + start, o.begin() + start + size);
    return d;
  }
  // Stream length per epoch: whole blocks of global_batch_ positions; a micro-batch never
  // straddles epochs.
  const int64_t block = global_batch_;
  const int64_t per_epoch = dataset_size_ / (members_ * block) * block;
  PT_INPUT_CHECK(size <= per_epoch, "a stream of ", per_epoch, " samples per epoch cannot hold a micro-batch of ", size);
  int64_t k = cursor_ % per_epoch;
  d.epoch = cursor_ / per_epoch;
  if (k + size > per_epoch) {  // skip the epoch's tail
    cursor_ += per_epoch - k;
    k = 0;
    ++d.epoch;
  }
  const auto& o = order(d.epoch);
  for (int64_t i = 0; i < size; ++i) {
    const int64_t j = k + i;  // block j / block of this stream is block (j / block) * members + member of the epoch
    d.indices.push_back(o[((j / block) * members_ + member_) * block + j % block]);
  }
  cursor_ += size;
  return d;
}

}  // namespace polytrain
