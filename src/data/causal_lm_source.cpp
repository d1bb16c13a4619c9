#include "polytrain/data/causal_lm_source.h"

#include <torch/torch.h>

#include "polytrain/common/error.h"

namespace polytrain {

CausalLmBatchSource::CausalLmBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset)
    : dataset_(dataset), subset_(std::move(subset)) {}

Batch CausalLmBatchSource::make_batch(const std::vector<int64_t>& indices, int64_t /*epoch*/) const {
  const int64_t b = static_cast<int64_t>(indices.size()), l = dataset_.seq_length();
  auto ids = torch::empty({b, l}, torch::kLong);
  auto* out = ids.data_ptr<int64_t>();
  const auto g = dataset_.gather(subset_, indices);
  for (int64_t r = 0; r < b; ++r) std::copy(g.samples[r]->begin(), g.samples[r]->end(), out + r * l);
  Batch batch;
  // Packed blocks have no padding: no attention_mask, so GPT-2's attention keeps the causal
  // kernels (flash on a GPU) instead of a materialised [B, 1, L, L] mask of ones.
  batch.set("input_ids", ids);
  batch.set("labels", ids);
  return batch;
}

}  // namespace polytrain
