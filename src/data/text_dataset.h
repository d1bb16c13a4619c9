// TokenBlockDataset: plain-text files -> paragraphs -> token stream -> fixed-length
// [CLS] block [SEP] samples for masked-LM training (plain blocks for causal LM), plus the deterministic train/eval split.
// Tokenization is the tokenizer's (data/wordpiece.h); masking and batching are the collator's
// (data/mlm_collator.h); sample order is sample_order.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace polytrain {

class WordPieceTokenizer;

class TokenBlockDataset {
 public:
  /// Tokenizes one paragraph (no special tokens added).
  using EncodeFn = std::function<std::vector<int64_t>(const std::string& paragraph)>;

  /// Reads `files` in order, splits each into paragraphs (blank-line separated; the lines of a
  /// paragraph are joined with single spaces, since Gutenberg text is hard-wrapped), tokenizes
  /// them with `tok` and packs the concatenated stream into blocks of max_seq_length - 2
  /// tokens, each sample being [CLS] block [SEP]; the last partial block is dropped.
  /// InputError naming the file when one is missing, unreadable or empty, and when the text
  /// does not fill a single block.
  static TokenBlockDataset build(const std::vector<std::string>& files,
                                 const WordPieceTokenizer& tok, int64_t max_seq_length);
  /// The same with any tokenizer. cls_id / sep_id < 0: not added (a causal LM packs plain
  /// blocks of max_seq_length tokens, as HF's run_clm group_texts does).
  static TokenBlockDataset build(const std::vector<std::string>& files, const EncodeFn& encode,
                                 int64_t cls_id, int64_t sep_id, int64_t max_seq_length);
  /// Packs an already tokenized stream (what build() does after reading and tokenizing).
  static TokenBlockDataset from_token_stream(const std::vector<int64_t>& stream, int64_t cls_id,
                                             int64_t sep_id, int64_t max_seq_length);

  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  /// Sample i: [CLS] + max_seq_length - 2 token ids + [SEP].
  const std::vector<int64_t>& sample(int64_t i) const;
  int64_t seq_length() const { return seq_length_; }
  /// What a BatchSource over `subset` of this dataset reads for its sample `indices`: the
  /// samples and their indices in the whole dataset (which keys per-sample randomness).
  struct Gathered {
    std::vector<const std::vector<int64_t>*> samples;
    std::vector<int64_t> dataset_indices;
  };
  Gathered gather(const std::vector<int64_t>& subset, const std::vector<int64_t>& indices) const;
  /// Tokens in the packed stream, including the dropped tail.
  int64_t num_tokens() const { return num_tokens_; }

 private:
  std::vector<std::vector<int64_t>> samples_;
  int64_t seq_length_ = 0;
  int64_t num_tokens_ = 0;
};

/// Sample indices of the train and eval parts, each sorted ascending.
struct DataSplit {
  std::vector<int64_t> train, eval;
};

/// Deterministic split of [0, n): a permutation keyed on `seed` gives its first
/// ceil(n * eval_fraction) indices to eval, at least 1 when eval_fraction > 0 and n > 1, and
/// always leaves at least 1 for train when n > 1. InputError when eval_fraction is outside [0, 1).
DataSplit split_train_eval(int64_t n, double eval_fraction, uint64_t seed);

}  // namespace polytrain
