// CausalLmBatchSource: a BatchSource over a subset of a TokenBlockDataset packed without
// special tokens, for next-token prediction (GPT-2). Samples are fixed-length blocks, so there
// is no padding and no randomness: labels are the input ids (the model shifts them).
#pragma once

#include <vector>

#include "polytrain/data/batch_source.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {

class CausalLmBatchSource : public BatchSource {
 public:
  /// `subset`: dataset indices making up this source. The dataset must outlive the source.
  CausalLmBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset);
  int64_t size() const override { return static_cast<int64_t>(subset_.size()); }
  /// input_ids [B, L] int64, attention_mask [B, L] (all ones), labels = input_ids.
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override;

 private:
  const TokenBlockDataset& dataset_;
  std::vector<int64_t> subset_;
};

}  // namespace polytrain
