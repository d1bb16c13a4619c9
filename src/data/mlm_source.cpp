#include "polytrain/data/mlm_source.h"

#include "polytrain/common/error.h"

namespace polytrain {

MlmBatchSource::MlmBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset,
                               const MlmCollator& collator, uint64_t seed)
    : dataset_(dataset), subset_(std::move(subset)), collator_(collator), seed_(seed) {}

Batch MlmBatchSource::make_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  const auto g = dataset_.gather(subset_, indices);
  return collator_.collate(g.samples, g.dataset_indices, epoch, seed_);
}

}  // namespace polytrain
