// T5 span corruption: the noise and span counts of random_spans_noise_mask (T5's float32,
// round-half-to-even arithmetic), the mask's shape and uniform segmentation, input/target
// lengths (T5's 512 -> 568/114), reconstruction from inputs + targets, sentinels, padding,
// determinism per (seed, epoch, sample), and the BatchSource over plain token blocks.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <vector>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/data/span_corruption.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {
namespace {

constexpr int64_t kSpSize = 8000, kVocab = 8100;  // the corpus model's layout: 8000 pieces + 100 sentinels

// Round half to even, written out (not std::nearbyint, which the code under test uses).
int64_t round_half_even(float x) {
  const float f = std::floor(x);
  const float diff = x - f;
  if (diff > 0.5f) return static_cast<int64_t>(f) + 1;
  if (diff < 0.5f) return static_cast<int64_t>(f);
  const auto i = static_cast<int64_t>(f);
  return i % 2 == 0 ? i : i + 1;
}

// Noise spans of a mask: lengths of the runs of `true`.
std::vector<int64_t> runs(const std::vector<bool>& mask, bool value) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] != value) continue;
    if (i == 0 || mask[i - 1] != value) out.push_back(0);
    ++out.back();
  }
  return out;
}

SpanCorruptor make_corruptor(int64_t inputs_length) {
  SpanCorruptionOptions opt;
  return SpanCorruptor(opt, SpanCorruptionIds{0, 1, kVocab, 100}, input_and_target_lengths(inputs_length, opt));
}

std::vector<int64_t> random_tokens(int64_t n, uint64_t key) {
  CounterRng rng(key);
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (auto& id : t) id = 3 + static_cast<int64_t>(rng.bounded(kSpSize - 3));  // no pad/eos/unk, no sentinel
  return t;
}

// Puts each sentinel's target span back where the sentinel stands in the inputs.
std::vector<int64_t> reconstruct(const CorruptedSample& s, const SpanCorruptor& c) {
  std::map<int64_t, std::vector<int64_t>> spans;
  int64_t current = -1;
  for (size_t i = 0; i + 1 < s.targets.size(); ++i) {  // the last target is eos
    if (c.is_sentinel(s.targets[i])) current = s.targets[i];
    else spans[current].push_back(s.targets[i]);
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i + 1 < s.inputs.size(); ++i) {
    if (c.is_sentinel(s.inputs[i])) out.insert(out.end(), spans[s.inputs[i]].begin(), spans[s.inputs[i]].end());
    else out.push_back(s.inputs[i]);
  }
  return out;
}

TEST(SpanCorruption, NoiseAndSpanCountsFollowT5) {
  SpanCorruptionOptions opt;
  for (int64_t len = 0; len <= 1200; ++len) {
    const NoiseCounts c = noise_counts(len, opt);
    const int64_t l = std::max<int64_t>(len, 2);
    int64_t noise = round_half_even(static_cast<float>(l) * 0.15f);
    noise = std::min<int64_t>(std::max<int64_t>(noise, 1), l - 1);
    const int64_t spans = std::max<int64_t>(round_half_even(static_cast<float>(noise) / 3.0f), 1);
    EXPECT_EQ(c.noise_tokens, noise) << len;
    EXPECT_EQ(c.nonnoise_tokens, l - noise) << len;
    EXPECT_EQ(c.noise_spans, spans) << len;
  }
  // Worked values (numpy float32 agrees): 10 * 0.15f = 1.5 -> 2 and 30 * 0.15f = 4.5 -> 4
  // (ties to even); 190 * 0.15f = 28.500002 -> 29 where float64's 28.499999999999996 gives 28
  // (HF's numpy port); 568 -> 85 noise in round(28.33) = 28 spans.
  EXPECT_EQ(noise_counts(10, opt).noise_tokens, 2);
  EXPECT_EQ(noise_counts(30, opt).noise_tokens, 4);
  EXPECT_EQ(noise_counts(190, opt).noise_tokens, 29);
  EXPECT_EQ(noise_counts(568, opt).noise_tokens, 85);
  EXPECT_EQ(noise_counts(568, opt).noise_spans, 28);
  EXPECT_EQ(noise_counts(1, opt).noise_tokens, 1);  // lengths below 2 count as 2
  // Tie in the span count: 15 noise tokens / 2.0 = 7.5 -> 8, 9 / 2.0 = 4.5 -> 4.
  SpanCorruptionOptions two{0.5, 2.0};
  EXPECT_EQ(noise_counts(30, two).noise_spans, 8);
  EXPECT_EQ(noise_counts(18, two).noise_spans, 4);
}

TEST(SpanCorruption, MaskHasTheCountedNoiseInTheCountedSpans) {
  SpanCorruptionOptions opt;
  for (int64_t len : {2, 3, 7, 10, 30, 50, 113, 114, 127, 142, 568}) {
    const NoiseCounts c = noise_counts(len, opt);
    for (uint64_t seed = 0; seed < 40; ++seed) {
      CounterRng a(mix_seed(seed, 1)), b(mix_seed(seed, 2));
      const auto mask = random_spans_noise_mask(len, opt, a, b);
      ASSERT_EQ(static_cast<int64_t>(mask.size()), len);
      const auto noise = runs(mask, true), plain = runs(mask, false);
      EXPECT_EQ(static_cast<int64_t>(noise.size()), c.noise_spans) << len;
      EXPECT_EQ(static_cast<int64_t>(plain.size()), c.noise_spans) << len;
      int64_t n = 0;
      for (int64_t r : noise) n += r;
      EXPECT_EQ(n, c.noise_tokens) << len;
      EXPECT_FALSE(mask.front()) << "starts with non-noise";
      EXPECT_TRUE(mask.back()) << "ends with noise";
    }
  }
  // Length 1: T5 computes a mask of 2 and keeps its first (non-noise) entry.
  CounterRng a(1), b(2);
  EXPECT_EQ(random_spans_noise_mask(1, opt, a, b), std::vector<bool>{false});
}

// 40 tokens: 6 noise tokens in 2 spans, so the first span's length is uniform on 1..5, and the
// 34 non-noise tokens' first run uniform on 1..33.
TEST(SpanCorruption, SegmentationIsUniform) {
  SpanCorruptionOptions opt;
  std::map<int64_t, int> first_noise, first_plain;
  const int draws = 6000;
  for (int d = 0; d < draws; ++d) {
    CounterRng a(mix_seed(7, d, 0)), b(mix_seed(7, d, 1));
    const auto mask = random_spans_noise_mask(40, opt, a, b);
    ++first_noise[runs(mask, true)[0]];
    ++first_plain[runs(mask, false)[0]];
  }
  ASSERT_EQ(first_noise.size(), 5u);
  for (const auto& [len, n] : first_noise) EXPECT_NEAR(n, draws / 5.0, draws / 5.0 * 0.12) << len;
  ASSERT_EQ(first_plain.size(), 33u);
  double chi2 = 0;
  for (const auto& [len, n] : first_plain) chi2 += std::pow(n - draws / 33.0, 2) / (draws / 33.0);
  EXPECT_LT(chi2, 70.0);  // 32 degrees of freedom: p < 1e-4 above 70
}

TEST(SpanCorruption, LengthsAreT5s) {
  SpanCorruptionOptions opt;
  // T5 / HF run_t5_mlm_flax: inputs 512 <- 568 raw tokens, targets 114.
  const SpanLengths l512 = input_and_target_lengths(512, opt);
  EXPECT_EQ(l512.tokens_length, 568);
  EXPECT_EQ(l512.inputs_length, 512);
  EXPECT_EQ(l512.targets_length, 114);
  for (int64_t in : {8, 16, 64, 100, 128, 256}) {
    const SpanLengths l = input_and_target_lengths(in, opt);
    const NoiseCounts c = noise_counts(l.tokens_length, opt), next = noise_counts(l.tokens_length + 1, opt);
    EXPECT_EQ(l.inputs_length, c.nonnoise_tokens + c.noise_spans + 1);
    EXPECT_EQ(l.targets_length, c.noise_tokens + c.noise_spans + 1);
    EXPECT_LE(l.inputs_length, in);
    EXPECT_GT(next.nonnoise_tokens + next.noise_spans + 1, in) << "tokens_length is the longest that fits";
  }
  EXPECT_THROW(input_and_target_lengths(1, opt), InputError);
}

TEST(SpanCorruption, InputsAndTargetsReconstructTheOriginal) {
  const SpanCorruptor c = make_corruptor(128);
  const SpanLengths& l = c.lengths();
  for (int64_t i = 0; i < 200; ++i) {
    const auto tokens = random_tokens(l.tokens_length, mix_seed(3, i));
    const CorruptedSample s = c.corrupt(tokens, i, 0, 42);
    ASSERT_EQ(static_cast<int64_t>(s.inputs.size()), l.inputs_length);
    ASSERT_EQ(static_cast<int64_t>(s.targets.size()), l.targets_length);
    EXPECT_EQ(s.inputs.back(), 1);
    EXPECT_EQ(s.targets.back(), 1);
    EXPECT_EQ(reconstruct(s, c), tokens) << "sample " << i;
    // Sentinels: <extra_id_0>, <extra_id_1>, ... once each, in order, in both sequences;
    // inputs never start with one (a non-noise run comes first), targets always do.
    std::vector<int64_t> in_sent, tgt_sent;
    for (int64_t id : s.inputs)
      if (c.is_sentinel(id)) in_sent.push_back(id);
    for (int64_t id : s.targets)
      if (c.is_sentinel(id)) tgt_sent.push_back(id);
    ASSERT_EQ(static_cast<int64_t>(in_sent.size()), noise_counts(l.tokens_length, SpanCorruptionOptions{}).noise_spans);
    EXPECT_EQ(in_sent, tgt_sent);
    for (size_t k = 0; k < in_sent.size(); ++k) EXPECT_EQ(in_sent[k], kVocab - 1 - static_cast<int64_t>(k));
    EXPECT_FALSE(c.is_sentinel(s.inputs.front()));
    EXPECT_EQ(s.targets.front(), kVocab - 1);
  }
  // Short samples (a tail block) corrupt by their own length.
  for (int64_t n : {1, 2, 5, 40}) {
    const auto tokens = random_tokens(n, 99);
    EXPECT_EQ(reconstruct(c.corrupt(tokens, n, 0, 42), c), tokens) << n;
  }
}

TEST(SpanCorruption, DeterministicPerSeedEpochAndSample) {
  const SpanCorruptor c = make_corruptor(64);
  const auto n = c.lengths().tokens_length;
  EXPECT_EQ(c.noise_mask(n, 5, 2, 9), c.noise_mask(n, 5, 2, 9));
  int differ_seed = 0, differ_epoch = 0, differ_sample = 0;
  for (int64_t i = 0; i < 50; ++i) {
    differ_seed += c.noise_mask(n, i, 0, 9) != c.noise_mask(n, i, 0, 10);
    differ_epoch += c.noise_mask(n, i, 0, 9) != c.noise_mask(n, i, 1, 9);
    differ_sample += c.noise_mask(n, i, 0, 9) != c.noise_mask(n, i + 1, 0, 9);
  }
  EXPECT_GE(differ_seed, 45);
  EXPECT_GE(differ_epoch, 45);
  EXPECT_GE(differ_sample, 45);
}

TEST(SpanCorruption, SentinelsAndOutOfVocabularyIdsInTheTextAreRefused) {
  const SpanCorruptor c = make_corruptor(32);
  auto tokens = random_tokens(c.lengths().tokens_length, 1);
  tokens[3] = kVocab - 1;  // <extra_id_0> in the text would collide with the first span's sentinel
  EXPECT_THROW(c.corrupt(tokens, 0, 0, 1), InputError);
  tokens[3] = kVocab;
  EXPECT_THROW(c.corrupt(tokens, 0, 0, 1), InputError);
  EXPECT_THROW(c.corrupt(random_tokens(c.lengths().tokens_length + 1, 1), 0, 0, 1), InputError);
  SpanCorruptionOptions opt;
  // 1500 raw tokens make 75 spans: fine with 100 sentinels, not with 50.
  EXPECT_NO_THROW(SpanCorruptor(opt, SpanCorruptionIds{0, 1, kVocab, 100}, input_and_target_lengths(1300, opt)));
  EXPECT_THROW(SpanCorruptor(opt, SpanCorruptionIds{0, 1, kVocab, 50}, input_and_target_lengths(1300, opt)),
               InputError);
  EXPECT_THROW(SpanCorruptor(SpanCorruptionOptions{1.0, 3.0}, SpanCorruptionIds{0, 1, kVocab, 100},
                             input_and_target_lengths(64, opt)),
               InputError);
  EXPECT_THROW(SpanCorruptor(opt, SpanCorruptionIds{0, kVocab - 1, kVocab, 100}, input_and_target_lengths(64, opt)),
               InputError);
}

TEST(SpanCorruption, BatchSourcePadsAndMatchesCorrupt) {
  const SpanCorruptor c = make_corruptor(48);
  const SpanLengths& l = c.lengths();
  // Plain blocks (no [CLS]/[SEP]) of tokens_length, and a stream 3.5 blocks long.
  const auto stream = random_tokens(l.tokens_length * 7 / 2, 5);
  const auto ds = TokenBlockDataset::from_token_stream(stream, -1, -1, l.tokens_length);
  ASSERT_EQ(ds.size(), 3);
  ASSERT_EQ(static_cast<int64_t>(ds.sample(1).size()), l.tokens_length);
  SpanCorruptionSource src(ds, {0, 1, 2}, c, 77);
  const Batch batch = src.make_batch({2, 0}, 3);
  ASSERT_EQ(batch.at("input_ids").sizes(), (std::vector<int64_t>{2, l.inputs_length}));
  ASSERT_EQ(batch.at("labels").sizes(), (std::vector<int64_t>{2, l.targets_length}));
  for (int64_t row = 0; row < 2; ++row) {
    const int64_t g = row == 0 ? 2 : 0;
    const CorruptedSample s = c.corrupt(ds.sample(g), g, 3, 77);
    auto ids = batch.at("input_ids")[row], labels = batch.at("labels")[row];
    EXPECT_EQ(std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + l.inputs_length), s.inputs);
    EXPECT_EQ(std::vector<int64_t>(labels.data_ptr<int64_t>(), labels.data_ptr<int64_t>() + l.targets_length),
              s.targets);
  }
  EXPECT_EQ(batch.at("attention_mask").sum().item<int64_t>(), 2 * l.inputs_length);
  // The same sample in another batch, position or order: the same rows.
  const Batch other = src.make_batch({0}, 3);
  EXPECT_TRUE(torch::equal(other.at("input_ids")[0], batch.at("input_ids")[1]));
  EXPECT_FALSE(torch::equal(src.make_batch({0}, 4).at("input_ids")[0], batch.at("input_ids")[1]));

  // A short sample is padded: pad 0 with mask 0 in the inputs, -100 with mask 0 in the labels.
  const std::vector<int64_t> short_tokens = random_tokens(20, 8);
  const Batch padded = c.collate({&short_tokens, &ds.sample(0)}, {10, 0}, 0, 1);
  const CorruptedSample s = c.corrupt(short_tokens, 10, 0, 1);
  const auto ni = static_cast<int64_t>(s.inputs.size()), nt = static_cast<int64_t>(s.targets.size());
  auto ids = padded.at("input_ids")[0], mask = padded.at("attention_mask")[0];
  auto labels = padded.at("labels")[0], dmask = padded.at("decoder_attention_mask")[0];
  EXPECT_EQ(mask.sum().item<int64_t>(), ni);
  EXPECT_EQ(dmask.sum().item<int64_t>(), nt);
  EXPECT_TRUE(torch::all(ids.slice(0, ni) == 0).item<bool>());
  EXPECT_TRUE(torch::all(labels.slice(0, nt) == -100).item<bool>());
  EXPECT_TRUE(torch::all(labels.slice(0, 0, nt) >= 0).item<bool>());
  EXPECT_EQ(padded.at("decoder_attention_mask")[1].sum().item<int64_t>(), l.targets_length);
}

}  // namespace
}  // namespace polytrain
