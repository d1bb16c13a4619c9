// Masked-LM collation: pads samples into a Batch and applies BERT's 80/10/10 masking
// (optionally whole-word), deterministically per (seed, epoch, global sample index).
// Knows nothing about tokenizers: the caller passes the special ids and per-id tables; which
// samples go into a batch (order, rank sharding) is the Trainer's business.
#pragma once

#include <cstdint>
#include <vector>

#include "polytrain/common/config.h"
#include "polytrain/data/batch.h"

namespace polytrain {

/// Vocabulary facts the collator needs.
struct MlmSpecialIds {
  int64_t pad = 0;
  int64_t cls = 101;
  int64_t sep = 102;
  int64_t mask = 103;
  int64_t unk = 100;
  int64_t vocab_size = 30522;
};

/// Builds {input_ids, attention_mask, token_type_ids, labels} (all int64, [B, L]) with the
/// semantics of Hugging Face's DataCollatorForLanguageModeling, using the DeepSpeed/NVIDIA
/// names of DataConfig: every candidate token (not special, not padding) is selected with
/// probability mask_prob; a selected token becomes [MASK] with probability
/// 1 - random_replace_prob - unmask_replace_prob, a uniformly drawn non-special id with
/// probability random_replace_prob, and stays unchanged otherwise. Every selected token gets
/// its original id as label; all other positions get -100.
///
/// Whole-word masking (cfg.whole_word_mask): a word is a non-continuation candidate token and
/// the continuation (##) candidates right after it; the select decision is drawn once per word
/// and applies to all its pieces, while the [MASK]/random/keep choice is drawn per piece (as
/// HF's DataCollatorForWholeWordMask and Google's create_pretraining_data.py do).
///
/// Determinism: the draws for a sample come from a CounterRng keyed on
/// (seed, epoch, global index) and position, so they never depend on the batch, its order,
/// the rank, or the other samples.
class MlmCollator {
 public:
  /// Counters for --inspect_batches, accumulated by collate when set_stats() was given one.
  struct Stats {
    int64_t candidates = 0;       ///< maskable tokens seen
    int64_t masked = 0;           ///< selected (labelled) tokens
    int64_t replaced_mask = 0;    ///< of masked: replaced by [MASK]
    int64_t replaced_random = 0;  ///< of masked: replaced by a random id (may equal the original)
    int64_t kept = 0;             ///< of masked: left unchanged
  };

  /// `is_continuation[id]`: id is a ## piece (needed only when cfg.whole_word_mask).
  /// `is_special[id]`: never masked, never drawn as a random replacement; pad, cls, sep, mask
  /// and unk are treated as special whatever the table says. Either table may be empty or
  /// shorter than vocab_size (missing ids: false). InputError on invalid probabilities.
  MlmCollator(const DataConfig& cfg, MlmSpecialIds ids, std::vector<bool> is_continuation,
              std::vector<bool> is_special);

  /// samples[i] has global index global_indices[i] in the epoch's sample stream. Samples of
  /// different lengths are right-padded with `pad` (attention_mask 0, labels -100).
  Batch collate(const std::vector<const std::vector<int64_t>*>& samples,
                const std::vector<int64_t>& global_indices, int64_t epoch, uint64_t seed) const;

  /// Masks one sample in place: `ids` becomes the model input, `labels` (resized) the
  /// targets. The building block of collate, exposed for tests and tools.
  void mask_sample(std::vector<int64_t>& ids, std::vector<int64_t>& labels,
                   int64_t global_index, int64_t epoch, uint64_t seed) const;

  /// Stats sink (not owned; nullptr = off). collate is then not safe to call concurrently.
  void set_stats(Stats* stats) { stats_ = stats; }

  const MlmSpecialIds& special_ids() const { return ids_; }

 private:
  bool special(int64_t id) const;
  bool continuation(int64_t id) const;

  MlmSpecialIds ids_;
  double mask_prob_;
  double mask_token_prob_;     ///< P([MASK] | selected)
  double random_token_prob_;   ///< P(random | selected)
  bool whole_word_;
  std::vector<bool> is_continuation_;
  std::vector<bool> is_special_;
  std::vector<int64_t> replacement_ids_;  ///< non-special ids, drawn uniformly
  Stats* stats_ = nullptr;
};

}  // namespace polytrain
