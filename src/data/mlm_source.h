// MlmBatchSource: a BatchSource over a subset (train or eval split) of a TokenBlockDataset,
// masked by an MlmCollator. Masking is keyed on the block's index in the whole dataset, so a
// sample is masked the same way whichever rank or micro-batch reads it.
#pragma once

#include <vector>

#include "polytrain/data/batch_source.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {

class MlmBatchSource : public BatchSource {
 public:
  /// `subset`: dataset indices making up this source (e.g. DataSplit::train). Not owned:
  /// dataset and collator must outlive the source.
  MlmBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset,
                 const MlmCollator& collator, uint64_t seed);
  int64_t size() const override { return static_cast<int64_t>(subset_.size()); }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override;

 private:
  const TokenBlockDataset& dataset_;
  std::vector<int64_t> subset_;
  const MlmCollator& collator_;
  uint64_t seed_;
};

}  // namespace polytrain
