// T5 span corruption (Raffel et al. 2020, t5.data.preprocessors.span_corruption): the noise
// mask of random_spans_noise_mask, sentinel replacement of the spans, the input/target length
// arithmetic, and a seq2seq BatchSource over plain token blocks. Tokenization is the
// tokenizer's (data/sentencepiece_tokenizer.h); which samples form a batch is the Trainer's.
#pragma once

#include <cstdint>
#include <vector>

#include "polytrain/data/batch_source.h"

namespace polytrain {

class CounterRng;
class TokenBlockDataset;

/// T5's span corruption hyper-parameters (its defaults).
struct SpanCorruptionOptions {
  double noise_density = 0.15;          ///< share of tokens masked
  double mean_noise_span_length = 3.0;  ///< mean length of a masked span
};

/// How many tokens and spans random_spans_noise_mask masks in a sequence of `length`:
/// noise = round(length * density) clamped to [1, length - 1], spans = max(round(noise / mean), 1),
/// with length raised to 2 first, float32 products and round-half-to-even as T5's TensorFlow
/// code computes them. Spans are further capped at the non-noise count, where T5 would fail.
struct NoiseCounts {
  int64_t noise_tokens = 0;
  int64_t nonnoise_tokens = 0;
  int64_t noise_spans = 0;
};
NoiseCounts noise_counts(int64_t length, const SpanCorruptionOptions& opt);

/// T5's random_spans_noise_mask: true = noise. Both the noise and the non-noise tokens are cut
/// into noise_spans segments at uniformly random places (a shuffled cut indicator, T5's
/// _random_segmentation; `noise_rng` and `nonnoise_rng` play its two seeds), and the segments
/// are interleaved starting with non-noise, so the sequence always ends in a noise span.
std::vector<bool> random_spans_noise_mask(int64_t length, const SpanCorruptionOptions& opt, CounterRng& noise_rng,
                                          CounterRng& nonnoise_rng);

/// T5's compute_input_and_target_lengths: the longest raw token count whose corrupted input
/// (non-noise + one sentinel per span + eos) fits in `inputs_length`, and the target length it
/// gives (noise + one sentinel per span + eos). Uses noise_counts, so the lengths are exactly
/// those corrupt() produces for a sequence of tokens_length tokens.
struct SpanLengths {
  int64_t tokens_length = 0;   ///< raw tokens per sample
  int64_t inputs_length = 0;   ///< <= the requested inputs_length
  int64_t targets_length = 0;
};
SpanLengths input_and_target_lengths(int64_t inputs_length, const SpanCorruptionOptions& opt);

/// The vocabulary facts span corruption needs.
struct SpanCorruptionIds {
  int64_t pad = 0;
  int64_t eos = 1;
  int64_t vocab_size = 0;      ///< extended vocabulary (model pieces + sentinels)
  int64_t num_sentinels = 100; ///< <extra_id_i> = vocab_size - 1 - i (HF T5Tokenizer)
};

/// One corrupted sample.
struct CorruptedSample {
  std::vector<int64_t> inputs;   ///< non-noise tokens, each noise span as one sentinel, eos
  std::vector<int64_t> targets;  ///< for each span: its sentinel then its tokens; then eos
};

/// Span corruption with per-sample keyed randomness, and the seq2seq collation.
class SpanCorruptor {
 public:
  /// InputError when the options are out of range, the ids do not fit the vocabulary, or a
  /// sequence of `lengths.tokens_length` needs more spans than there are sentinels.
  SpanCorruptor(SpanCorruptionOptions opt, SpanCorruptionIds ids, SpanLengths lengths);

  /// Corrupts `tokens` (no eos, no sentinels: InputError when one holds a sentinel or an id
  /// outside the vocabulary). The mask depends only on (seed, epoch, global_index).
  CorruptedSample corrupt(const std::vector<int64_t>& tokens, int64_t global_index, int64_t epoch,
                          uint64_t seed) const;
  /// The noise mask corrupt() uses for a sequence of `length` tokens.
  std::vector<bool> noise_mask(int64_t length, int64_t global_index, int64_t epoch, uint64_t seed) const;

  /// {input_ids, attention_mask [B, inputs_length]; labels, decoder_attention_mask
  /// [B, targets_length]}, int64. Inputs are padded with pad (mask 0), labels with -100.
  /// InputError when a sample is longer than tokens_length.
  Batch collate(const std::vector<const std::vector<int64_t>*>& samples, const std::vector<int64_t>& global_indices,
                int64_t epoch, uint64_t seed) const;

  const SpanLengths& lengths() const { return lengths_; }
  const SpanCorruptionIds& ids() const { return ids_; }
  int64_t sentinel(int64_t i) const { return ids_.vocab_size - 1 - i; }
  bool is_sentinel(int64_t id) const {
    return id < ids_.vocab_size && id >= ids_.vocab_size - ids_.num_sentinels;
  }

 private:
  SpanCorruptionOptions opt_;
  SpanCorruptionIds ids_;
  SpanLengths lengths_;
};

/// A BatchSource over a subset of a TokenBlockDataset of plain blocks (no [CLS]/[SEP]) of
/// tokens_length tokens, corrupted by a SpanCorruptor keyed on each block's dataset index.
/// Dataset and corruptor are not owned and must outlive the source.
class SpanCorruptionSource : public BatchSource {
 public:
  SpanCorruptionSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset, const SpanCorruptor& corruptor,
                       uint64_t seed);
  int64_t size() const override { return static_cast<int64_t>(subset_.size()); }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override;

 private:
  const TokenBlockDataset& dataset_;
  std::vector<int64_t> subset_;
  const SpanCorruptor& corruptor_;
  uint64_t seed_;
};

}  // namespace polytrain
