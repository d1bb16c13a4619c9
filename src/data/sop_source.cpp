// SopBatchSource: cut, maybe swap, then the MLM collator's masking and padding; the segment
// types and the order labels are added to the collator's batch.
#include "polytrain/data/sop_source.h"

#include <algorithm>
#include <utility>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"

namespace polytrain {
namespace {

constexpr uint64_t kSopDomain = 0x736F7073706C6974ULL;  // "sopsplit"

}  // namespace

SopBatchSource::SopBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset,
                               const MlmCollator& collator, uint64_t seed, SopOptions options)
    : dataset_(dataset), subset_(std::move(subset)), collator_(collator), seed_(seed), options_(std::move(options)) {
  PT_INPUT_CHECK(options_.max_seq_length >= 5, "data.max_seq_length (", options_.max_seq_length,
                 ") leaves no room for [CLS] A [SEP] B [SEP] with two non-empty segments (need >= 5)");
  const int64_t vocab = collator_.special_ids().vocab_size;
  sentence_end_.assign(static_cast<size_t>(vocab), false);
  for (int64_t id : options_.sentence_end_ids)
    if (id >= 0 && id < vocab) sentence_end_[static_cast<size_t>(id)] = true;
}

SopPair SopBatchSource::make_pair(int64_t dataset_index, int64_t epoch) const {
  const MlmSpecialIds& ids = collator_.special_ids();
  const std::vector<int64_t>& block = dataset_.sample(dataset_index);
  // The block's text: without its own [CLS] ... [SEP] when it has them.
  auto begin = block.begin(), end = block.end();
  if (begin != end && *begin == ids.cls) ++begin;
  if (end != begin && *(end - 1) == ids.sep) --end;
  const int64_t n = std::min<int64_t>(end - begin, options_.max_seq_length - 3);
  PT_INPUT_CHECK(n >= 2, "sentence-order prediction needs blocks of at least 2 tokens; block ", dataset_index,
                 " has ", n);
  end = begin + n;

  CounterRng rng(mix_seed(seed_, static_cast<uint64_t>(epoch), static_cast<uint64_t>(dataset_index), kSopDomain));
  const int64_t margin = std::max<int64_t>(1, n / 4);
  const int64_t lo = margin, hi = n - margin;  // split s in [lo, hi]: A = t[0, s), B = t[s, n)
  std::vector<int64_t> boundaries;
  for (int64_t s = lo; s <= hi; ++s) {
    const int64_t id = begin[s - 1];  // an id outside the vocabulary is the collator's error, later
    if (id >= 0 && id < static_cast<int64_t>(sentence_end_.size()) && sentence_end_[static_cast<size_t>(id)])
      boundaries.push_back(s);
  }
  const int64_t split = boundaries.empty()
                            ? lo + static_cast<int64_t>(rng.bounded(static_cast<uint64_t>(hi - lo + 1)))
                            : boundaries[rng.bounded(boundaries.size())];
  const bool swap = rng.next_double() < 0.5;

  SopPair p;
  p.a_length = split;
  p.sentence_order_label = swap ? 1 : 0;
  const auto first_begin = swap ? begin + split : begin, first_end = swap ? end : begin + split;
  const auto second_begin = swap ? begin : begin + split, second_end = swap ? begin + split : end;
  p.input_ids.reserve(static_cast<size_t>(n + 3));
  p.input_ids.push_back(ids.cls);
  p.input_ids.insert(p.input_ids.end(), first_begin, first_end);
  p.input_ids.push_back(ids.sep);
  const size_t first_part = p.input_ids.size();
  p.input_ids.insert(p.input_ids.end(), second_begin, second_end);
  p.input_ids.push_back(ids.sep);
  p.token_type_ids.assign(p.input_ids.size(), 1);
  std::fill(p.token_type_ids.begin(), p.token_type_ids.begin() + static_cast<std::ptrdiff_t>(first_part), 0);
  return p;
}

Batch SopBatchSource::make_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  const auto g = dataset_.gather(subset_, indices);
  std::vector<SopPair> pairs;
  pairs.reserve(indices.size());
  std::vector<const std::vector<int64_t>*> samples;
  for (int64_t index : g.dataset_indices) {
    pairs.push_back(make_pair(index, epoch));
    samples.push_back(&pairs.back().input_ids);
  }
  // Masking and padding are the collator's (keyed on the same dataset index); the collator's
  // token_type_ids (all 0) are replaced by the segments', padding positions staying 0.
  Batch batch = collator_.collate(samples, g.dataset_indices, epoch, seed_);
  at::Tensor types = torch::zeros_like(batch.at("input_ids"));
  at::Tensor labels = torch::empty({static_cast<int64_t>(pairs.size())}, torch::kLong);
  const int64_t width = types.size(1);
  int64_t* t = types.data_ptr<int64_t>();
  int64_t* l = labels.data_ptr<int64_t>();
  for (size_t i = 0; i < pairs.size(); ++i) {
    std::copy(pairs[i].token_type_ids.begin(), pairs[i].token_type_ids.end(), t + static_cast<int64_t>(i) * width);
    l[i] = pairs[i].sentence_order_label;
  }
  batch.set("token_type_ids", types);
  batch.set("sentence_order_label", labels);
  return batch;
}

}  // namespace polytrain
