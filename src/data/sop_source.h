// SopBatchSource: ALBERT's pre-training samples (masked LM + sentence-order prediction) over a
// subset of a TokenBlockDataset: each block is cut into two consecutive segments A and B, which
// are swapped half of the time, then masked by an MlmCollator. Tokenization is the dataset's;
// which samples go into a batch is the Trainer's.
#pragma once

#include <cstdint>
#include <vector>

#include "polytrain/data/batch_source.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {

/// How SopBatchSource cuts a block.
struct SopOptions {
  /// Length of a sample, [CLS] A [SEP] B [SEP]: a block's text beyond max_seq_length - 3 tokens
  /// is cut off (build the dataset with max_seq_length - 1 so that nothing is).
  int64_t max_seq_length = 128;
  /// Ids that end a sentence ("." "?" "!"): the split point is drawn among the positions right
  /// after one of them in the middle half of the block, as ALBERT's create_pretraining_data.py
  /// draws it among sentence boundaries. None there (or an empty list): any position of the
  /// middle half.
  std::vector<int64_t> sentence_end_ids;
};

/// One sample before masking: what make_batch masks and pads.
struct SopPair {
  std::vector<int64_t> input_ids;       ///< [CLS] first [SEP] second [SEP]
  std::vector<int64_t> token_type_ids;  ///< 0 up to and including the middle [SEP], then 1
  int64_t sentence_order_label = 0;     ///< 0: first = A (in order), 1: first = B (swapped)
  int64_t a_length = 0;                 ///< tokens of A (the block's first segment)
};

/// ALBERT's sentence-order-prediction data (Lan et al. 2019, section 4.1; HF
/// AlbertForPreTraining's sentence_order_label) from packed text blocks. For the block of
/// dataset index g, with its n text tokens t (the block without its [CLS] and [SEP]):
///  - the split point s is drawn in the middle half, [max(1, n/4), n - max(1, n/4)], preferring
///    sentence ends (SopOptions::sentence_end_ids); A = t[0, s), B = t[s, n): consecutive text
///    of one block, so both segments are non-empty and neither is much shorter than the other;
///  - with probability 0.5 the segments are swapped: the sample is [CLS] B [SEP] A [SEP] with
///    sentence_order_label 1, else [CLS] A [SEP] B [SEP] with label 0 (ALBERT's SOP: the
///    negative is the same two segments in the wrong order, not a segment of another text);
///  - token_type_ids are 0 over [CLS] first [SEP] and 1 over second [SEP];
///  - then the collator's masking (BERT's 80/10/10; [CLS] and [SEP] are never masked).
/// A block may run across a paragraph or file boundary (the dataset packs one token stream);
/// ALBERT's own data keeps to one document.
///
/// Determinism: split and swap come from a CounterRng keyed on (seed, epoch, g) in a domain of
/// their own, masking from the collator's key on the same triple: a sample is the same whichever
/// rank or micro-batch reads it, and is cut and swapped anew each epoch.
///
/// The Batch: input_ids, attention_mask, token_type_ids, labels ([B, L], int64, as
/// MlmCollator::collate) and sentence_order_label ([B], int64).
class SopBatchSource : public BatchSource {
 public:
  /// `subset`: dataset indices making up this source (e.g. DataSplit::train). Not owned: dataset
  /// and collator must outlive the source. InputError when max_seq_length < 5 (room for two
  /// one-token segments).
  SopBatchSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset, const MlmCollator& collator,
                 uint64_t seed, SopOptions options);
  int64_t size() const override { return static_cast<int64_t>(subset_.size()); }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override;

  /// The unmasked sample of dataset block `dataset_index` in `epoch` (tests, --inspect_batches).
  /// InputError when the block has fewer than 2 text tokens.
  SopPair make_pair(int64_t dataset_index, int64_t epoch) const;

 private:
  const TokenBlockDataset& dataset_;
  std::vector<int64_t> subset_;
  const MlmCollator& collator_;
  uint64_t seed_;
  SopOptions options_;
  std::vector<bool> sentence_end_;  ///< by id
};

}  // namespace polytrain
