// T5 span corruption: noise counts, the interleaved random-span mask, sentinel replacement,
// length arithmetic, collation and the BatchSource. Each sample's two segmentation streams are
// CounterRngs keyed on (seed, epoch, sample index), so a mask never depends on the batch.
#include "polytrain/data/span_corruption.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {
namespace {

constexpr int64_t kIgnoreIndex = -100;                   // torch cross_entropy's default ignore_index
constexpr uint64_t kSpanDomain = 0x74357370616E7331ULL;  // "t5spans1"

// T5's _random_segmentation: num_items items cut into num_segments non-empty runs at uniformly
// random places. A 0/1 "starts a new segment" indicator over items 1..num_items-1 holding
// num_segments - 1 ones is shuffled (Fisher-Yates here, seqio.stateless_shuffle there).
std::vector<int64_t> random_segmentation(int64_t num_items, int64_t num_segments, CounterRng& rng) {
  PT_CHECK(num_segments >= 1 && num_segments <= num_items, num_segments, " segments of ", num_items, " items");
  std::vector<char> first_in_segment(static_cast<size_t>(num_items - 1), 0);
  std::fill(first_in_segment.begin(), first_in_segment.begin() + (num_segments - 1), 1);
  for (int64_t i = num_items - 2; i > 0; --i)
    std::swap(first_in_segment[i], first_in_segment[rng.bounded(static_cast<uint64_t>(i) + 1)]);
  std::vector<int64_t> lengths(static_cast<size_t>(num_segments), 0);
  size_t segment = 0;
  lengths[0] = 1;
  for (char starts : first_in_segment) {
    if (starts) ++segment;
    ++lengths[segment];
  }
  return lengths;
}

void check_options(const SpanCorruptionOptions& opt) {
  PT_INPUT_CHECK(opt.noise_density > 0.0 && opt.noise_density < 1.0,
                 "span corruption: noise_density must be in (0, 1), got ", opt.noise_density);
  PT_INPUT_CHECK(opt.mean_noise_span_length >= 1.0, "span corruption: mean_noise_span_length must be >= 1, got ",
                 opt.mean_noise_span_length);
}

}  // namespace

NoiseCounts noise_counts(int64_t length, const SpanCorruptionOptions& opt) {
  const int64_t len = std::max<int64_t>(length, 2);
  // float32 products and round-half-to-even (std::nearbyint in the default rounding mode),
  // as tf.round(tf.cast(length, tf.float32) * noise_density) computes them.
  const float noise_f = std::nearbyint(static_cast<float>(len) * static_cast<float>(opt.noise_density));
  NoiseCounts c;
  c.noise_tokens = std::min<int64_t>(std::max<int64_t>(static_cast<int64_t>(noise_f), 1), len - 1);
  c.nonnoise_tokens = len - c.noise_tokens;
  const float spans_f =
      std::nearbyint(static_cast<float>(c.noise_tokens) / static_cast<float>(opt.mean_noise_span_length));
  c.noise_spans = std::max<int64_t>(static_cast<int64_t>(spans_f), 1);
  // Every span needs a non-noise run before it; T5's reshape would fail here instead.
  c.noise_spans = std::min(c.noise_spans, c.nonnoise_tokens);
  return c;
}

std::vector<bool> random_spans_noise_mask(int64_t length, const SpanCorruptionOptions& opt, CounterRng& noise_rng,
                                          CounterRng& nonnoise_rng) {
  PT_CHECK(length >= 0, "negative length ", length);
  const NoiseCounts c = noise_counts(length, opt);
  const auto noise = random_segmentation(c.noise_tokens, c.noise_spans, noise_rng);
  const auto nonnoise = random_segmentation(c.nonnoise_tokens, c.noise_spans, nonnoise_rng);
  std::vector<bool> mask;
  mask.reserve(static_cast<size_t>(c.noise_tokens + c.nonnoise_tokens));
  for (int64_t s = 0; s < c.noise_spans; ++s) {
    mask.insert(mask.end(), static_cast<size_t>(nonnoise[s]), false);
    mask.insert(mask.end(), static_cast<size_t>(noise[s]), true);
  }
  mask.resize(static_cast<size_t>(length));  // T5 computes lengths < 2 as 2, then truncates
  return mask;
}

SpanLengths input_and_target_lengths(int64_t inputs_length, const SpanCorruptionOptions& opt) {
  check_options(opt);
  PT_INPUT_CHECK(inputs_length >= 2, "span corruption needs an input length of at least 2, got ", inputs_length);
  auto lengths_of = [&](int64_t tokens) {
    const NoiseCounts c = noise_counts(tokens, opt);
    return SpanLengths{tokens, c.nonnoise_tokens + c.noise_spans + 1, c.noise_tokens + c.noise_spans + 1};
  };
  // T5 starts at inputs_length - 1 tokens (no noise at all would need exactly that many).
  int64_t tokens = inputs_length - 1;
  while (lengths_of(tokens + 1).inputs_length <= inputs_length) ++tokens;
  SpanLengths out = lengths_of(tokens);
  PT_INPUT_CHECK(out.inputs_length <= inputs_length, "span corruption: no token count fits an input length of ",
                 inputs_length);
  return out;
}

SpanCorruptor::SpanCorruptor(SpanCorruptionOptions opt, SpanCorruptionIds ids, SpanLengths lengths)
    : opt_(opt), ids_(ids), lengths_(lengths) {
  check_options(opt_);
  PT_INPUT_CHECK(ids_.num_sentinels >= 1 && ids_.num_sentinels < ids_.vocab_size,
                 "span corruption: ", ids_.num_sentinels, " sentinels do not fit a vocabulary of ", ids_.vocab_size);
  for (int64_t id : {ids_.pad, ids_.eos})
    PT_INPUT_CHECK(id >= 0 && id < ids_.vocab_size - ids_.num_sentinels, "span corruption: pad/eos id ", id,
                   " must be a non-sentinel id of the vocabulary");
  PT_INPUT_CHECK(lengths_.tokens_length >= 1, "span corruption: tokens_length must be >= 1");
  const NoiseCounts c = noise_counts(lengths_.tokens_length, opt_);
  PT_INPUT_CHECK(c.noise_spans <= ids_.num_sentinels, "span corruption: ", lengths_.tokens_length,
                 " tokens make ", c.noise_spans, " noise spans but there are only ", ids_.num_sentinels,
                 " sentinels (lower data.max_seq_length)");
}

std::vector<bool> SpanCorruptor::noise_mask(int64_t length, int64_t global_index, int64_t epoch,
                                            uint64_t seed) const {
  const uint64_t key = mix_seed(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(global_index), kSpanDomain);
  CounterRng noise_rng(mix_seed(key, 0)), nonnoise_rng(mix_seed(key, 1));
  return random_spans_noise_mask(length, opt_, noise_rng, nonnoise_rng);
}

CorruptedSample SpanCorruptor::corrupt(const std::vector<int64_t>& tokens, int64_t global_index, int64_t epoch,
                                       uint64_t seed) const {
  const auto n = static_cast<int64_t>(tokens.size());
  PT_INPUT_CHECK(n <= lengths_.tokens_length, "sample ", global_index, " has ", n,
                 " tokens, more than the span corruption length ", lengths_.tokens_length);
  const std::vector<bool> mask = noise_mask(n, global_index, epoch, seed);
  CorruptedSample out;
  out.inputs.reserve(static_cast<size_t>(lengths_.inputs_length));
  out.targets.reserve(static_cast<size_t>(lengths_.targets_length));
  int64_t span = -1;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t id = tokens[p];
    PT_INPUT_CHECK(id >= 0 && id < ids_.vocab_size && !is_sentinel(id), "token id ", id, " at position ", p,
                   " of sample ", global_index, " is a sentinel or outside the vocabulary [0, ",
                   ids_.vocab_size - ids_.num_sentinels, ")");
    if (!mask[p]) {
      out.inputs.push_back(id);
      continue;
    }
    if (p == 0 || !mask[p - 1]) {  // a span starts: <extra_id_k> in both sequences
      ++span;
      out.inputs.push_back(sentinel(span));
      out.targets.push_back(sentinel(span));
    }
    out.targets.push_back(id);
  }
  out.inputs.push_back(ids_.eos);
  out.targets.push_back(ids_.eos);
  return out;
}

Batch SpanCorruptor::collate(const std::vector<const std::vector<int64_t>*>& samples,
                             const std::vector<int64_t>& global_indices, int64_t epoch, uint64_t seed) const {
  PT_CHECK(!samples.empty(), "collate of an empty batch");
  PT_CHECK(samples.size() == global_indices.size(), samples.size(), " samples but ", global_indices.size(),
           " global indices");
  const auto b = static_cast<int64_t>(samples.size());
  const int64_t li = lengths_.inputs_length, lt = lengths_.targets_length;
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  at::Tensor input_ids = torch::full({b, li}, ids_.pad, opts);
  at::Tensor attention = torch::zeros({b, li}, opts);
  at::Tensor labels = torch::full({b, lt}, kIgnoreIndex, opts);
  at::Tensor decoder_attention = torch::zeros({b, lt}, opts);
  int64_t* in_p = input_ids.data_ptr<int64_t>();
  int64_t* att_p = attention.data_ptr<int64_t>();
  int64_t* lab_p = labels.data_ptr<int64_t>();
  int64_t* datt_p = decoder_attention.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    PT_CHECK(samples[i] != nullptr, "null sample");
    const CorruptedSample s = corrupt(*samples[i], global_indices[i], epoch, seed);
    // Shorter samples make shorter sequences; the fixed lengths bound every sample's.
    PT_CHECK(static_cast<int64_t>(s.inputs.size()) <= li && static_cast<int64_t>(s.targets.size()) <= lt,
             "corrupted sample of ", s.inputs.size(), "/", s.targets.size(), " tokens exceeds ", li, "/", lt);
    std::copy(s.inputs.begin(), s.inputs.end(), in_p + i * li);
    std::fill(att_p + i * li, att_p + i * li + static_cast<int64_t>(s.inputs.size()), 1);
    std::copy(s.targets.begin(), s.targets.end(), lab_p + i * lt);
    std::fill(datt_p + i * lt, datt_p + i * lt + static_cast<int64_t>(s.targets.size()), 1);
  }
  Batch batch;
  batch.set("input_ids", input_ids);
  batch.set("attention_mask", attention);
  batch.set("labels", labels);
  batch.set("decoder_attention_mask", decoder_attention);
  return batch;
}

SpanCorruptionSource::SpanCorruptionSource(const TokenBlockDataset& dataset, std::vector<int64_t> subset,
                                           const SpanCorruptor& corruptor, uint64_t seed)
    : dataset_(dataset), subset_(std::move(subset)), corruptor_(corruptor), seed_(seed) {}

Batch SpanCorruptionSource::make_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  const auto g = dataset_.gather(subset_, indices);
  return corruptor_.collate(g.samples, g.dataset_indices, epoch, seed_);
}

}  // namespace polytrain
