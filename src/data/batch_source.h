// What the Trainer reads samples through: a sized source that builds a Batch for given
// sample indices. Datasets + collators implement it; the loop decides which indices.
#pragma once

#include <cstdint>
#include <vector>

#include "polytrain/data/batch.h"

namespace polytrain {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  /// Number of samples (indices 0..size()-1).
  virtual int64_t size() const = 0;
  /// The batch of samples `indices`; any randomness (masking) depends only on the seed, the
  /// epoch and each sample's own index, never on the batch it lands in or the rank reading it.
  virtual Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const = 0;
};

}  // namespace polytrain
