#include "data/mlm_source.h"

#include "common/error.h"

namespace polytrain {

MlmBatchSource::MlmBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset,
                               const MlmCollator& collator, uint64_t seed)
    : dataset_(dataset), subset_(std::move(subset)), collator_(collator), seed_(seed) {}

Batch MlmBatchSource::make_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  std::vector<const std::vector<int64_t>*> samples;
  std::vector<int64_t> global;
  samples.reserve(indices.size());
  global.reserve(indices.size());
  for (int64_t i : indices) {
    PT_CHECK(i >= 0 && i < size(), "sample index ", i, " out of range ", size());
    const int64_t g = subset_[static_cast<size_t>(i)];
    samples.push_back(&dataset_.sample(g));
    global.push_back(g);
  }
  return collator_.collate(samples, global, epoch, seed_);
}

}  // namespace polytrain
