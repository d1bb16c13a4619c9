// Tests of SopBatchSource (data/sop_source.h), ALBERT's sentence-order samples: the layout
// [CLS] first [SEP] second [SEP] and its token types, swapped pairs being the block's two
// segments in the other order, the split point, the label balance, masking on top, and
// determinism per (seed, epoch, sample). Synthetic blocks, no assets.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/sop_source.h"
#include "polytrain/data/text_dataset.h"

namespace polytrain {
namespace {

// Toy vocabulary: 0 [PAD], 1 [UNK], 2 [CLS], 3 [SEP], 4 [MASK], 5 ".", ordinary ids 6..999.
constexpr int64_t kVocab = 1000, kDot = 5;
const MlmSpecialIds kIds{0, 2, 3, 4, 1, kVocab};

// A stream where every token is distinct within a block (so a segment is found by its values):
// 0..n-1 mapped to 6.., with a "." after every `sentence`-th token when sentence > 0.
std::vector<int64_t> stream(int64_t n, int64_t sentence = 0) {
  std::vector<int64_t> s;
  for (int64_t i = 0; i < n; ++i) s.push_back(sentence > 0 && i % sentence == sentence - 1 ? kDot : 6 + i % 990);
  return s;
}

MlmCollator collator(double mask_prob = 0.15) {
  DataConfig d;
  d.mask_prob = mask_prob;
  std::vector<bool> special(kVocab, false);
  for (int i = 0; i < 5; ++i) special[i] = true;
  return MlmCollator(d, kIds, {}, special);
}

std::vector<int64_t> all_indices(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// The block's text tokens (without its [CLS] / [SEP]).
std::vector<int64_t> text_of(const TokenBlockDataset& ds, int64_t i) {
  const auto& b = ds.sample(i);
  return {b.begin() + 1, b.end() - 1};
}

TEST(SopSource, LayoutTypesAndSwappedSegmentsAreTheBlockInTheOtherOrder) {
  const auto ds = TokenBlockDataset::from_token_stream(stream(40 * 61), kIds.cls, kIds.sep, 63);  // 61 text tokens
  const auto coll = collator();
  const SopBatchSource src(ds, all_indices(ds.size()), coll, 7, SopOptions{64, {}});
  int swapped = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const SopPair p = src.make_pair(i, 0);
    const auto text = text_of(ds, i);
    const int64_t n = static_cast<int64_t>(text.size());
    ASSERT_EQ(static_cast<int64_t>(p.input_ids.size()), n + 3);
    ASSERT_EQ(p.input_ids.front(), kIds.cls);
    ASSERT_EQ(p.input_ids.back(), kIds.sep);
    const auto mid = std::find(p.input_ids.begin() + 1, p.input_ids.end() - 1, kIds.sep);
    ASSERT_NE(mid, p.input_ids.end() - 1) << "no [SEP] between the segments";
    EXPECT_EQ(std::count(p.input_ids.begin(), p.input_ids.end(), kIds.sep), 2);
    const std::vector<int64_t> first(p.input_ids.begin() + 1, mid), second(mid + 1, p.input_ids.end() - 1);
    ASSERT_FALSE(first.empty());
    ASSERT_FALSE(second.empty());
    // Token types: 0 over [CLS] first [SEP], 1 over second [SEP].
    const auto sep_pos = static_cast<size_t>(mid - p.input_ids.begin());
    for (size_t t = 0; t < p.token_type_ids.size(); ++t) ASSERT_EQ(p.token_type_ids[t], t <= sep_pos ? 0 : 1) << t;
    ASSERT_TRUE(p.sentence_order_label == 0 || p.sentence_order_label == 1);
    // In order: first + second is the block; swapped: second + first is (B came before A).
    std::vector<int64_t> joined = p.sentence_order_label ? second : first;
    const auto& rest = p.sentence_order_label ? first : second;
    joined.insert(joined.end(), rest.begin(), rest.end());
    EXPECT_EQ(joined, text) << "block " << i << " label " << p.sentence_order_label;
    EXPECT_EQ(p.a_length, static_cast<int64_t>((p.sentence_order_label ? second : first).size()));
    // The split lies in the middle half.
    EXPECT_GE(p.a_length, n / 4);
    EXPECT_LE(p.a_length, n - n / 4);
    swapped += static_cast<int>(p.sentence_order_label);
  }
  EXPECT_GT(swapped, 0);
  EXPECT_LT(swapped, ds.size());
}

TEST(SopSource, LabelsAreBalancedAndSplitsVary) {
  const auto ds = TokenBlockDataset::from_token_stream(stream(4000 * 21), kIds.cls, kIds.sep, 23);
  const auto coll = collator();
  const SopBatchSource src(ds, all_indices(ds.size()), coll, 1234, SopOptions{24, {}});
  int64_t swapped = 0;
  std::vector<int64_t> split_count(22, 0);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const SopPair p = src.make_pair(i, 0);
    swapped += p.sentence_order_label;
    ++split_count[static_cast<size_t>(p.a_length)];
  }
  const double share = static_cast<double>(swapped) / static_cast<double>(ds.size());
  EXPECT_NEAR(share, 0.5, 0.03) << swapped << " of " << ds.size();  // 4000 draws: sd 0.008
  // n = 21: splits 5..16, each drawn (12 values, ~333 times each).
  for (int64_t s = 0; s < 22; ++s) {
    if (s >= 5 && s <= 16)
      EXPECT_GT(split_count[static_cast<size_t>(s)], 200) << s;
    else
      EXPECT_EQ(split_count[static_cast<size_t>(s)], 0) << s;
  }
}

TEST(SopSource, SplitsAfterASentenceEndWhenTheMiddleHalfHasOne) {
  // A "." every 10th token: the middle half of each 61-token block (splits 15..46) holds three.
  const auto ds = TokenBlockDataset::from_token_stream(stream(200 * 61, 10), kIds.cls, kIds.sep, 63);
  const auto coll = collator();
  const SopBatchSource src(ds, all_indices(ds.size()), coll, 3, SopOptions{64, {kDot}});
  std::vector<int64_t> seen;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const SopPair p = src.make_pair(i, 0);
    const auto text = text_of(ds, i);
    ASSERT_EQ(text[static_cast<size_t>(p.a_length - 1)], kDot) << "block " << i << " split " << p.a_length;
    seen.push_back(p.a_length);
  }
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
  EXPECT_GE(seen.size(), 2u) << "the sentence end is drawn, not always the same";
  // Without a sentence end in the middle half, any point of it.
  const auto plain = TokenBlockDataset::from_token_stream(stream(50 * 61), kIds.cls, kIds.sep, 63);
  const SopBatchSource src2(plain, all_indices(plain.size()), coll, 3, SopOptions{64, {kDot}});
  EXPECT_NO_THROW(src2.make_pair(0, 0));
}

TEST(SopSource, BatchMasksThePairAndKeepsTypesAndLabels) {
  const auto ds = TokenBlockDataset::from_token_stream(stream(16 * 29), kIds.cls, kIds.sep, 31);
  const auto coll = collator(0.3);
  const SopBatchSource src(ds, all_indices(ds.size()), coll, 11, SopOptions{32, {}});
  const Batch b = src.make_batch({0, 1, 2, 3, 4, 5, 6, 7}, 2);
  for (const char* key : {"input_ids", "attention_mask", "token_type_ids", "labels"}) {
    ASSERT_TRUE(b.has(key)) << key;
    EXPECT_EQ(b.at(key).sizes(), (std::vector<int64_t>{8, 32})) << key;
  }
  ASSERT_TRUE(b.has("sentence_order_label"));
  EXPECT_EQ(b.at("sentence_order_label").sizes(), (std::vector<int64_t>{8}));
  EXPECT_EQ(b.at("sentence_order_label").scalar_type(), torch::kLong);
  int64_t masked = 0;
  for (int64_t s = 0; s < 8; ++s) {
    const SopPair p = src.make_pair(s, 2);
    EXPECT_EQ(b.at("sentence_order_label")[s].item<int64_t>(), p.sentence_order_label);
    for (int64_t t = 0; t < 32; ++t) {
      const auto u = static_cast<size_t>(t);
      EXPECT_EQ(b.at("token_type_ids")[s][t].item<int64_t>(), p.token_type_ids[u]);
      EXPECT_EQ(b.at("attention_mask")[s][t].item<int64_t>(), 1);
      const int64_t label = b.at("labels")[s][t].item<int64_t>(), id = b.at("input_ids")[s][t].item<int64_t>();
      if (label == -100) {
        EXPECT_EQ(id, p.input_ids[u]) << "an unlabelled position keeps its token";
      } else {
        EXPECT_EQ(label, p.input_ids[u]) << "the label is the pair's token";
        ++masked;
      }
      if (p.input_ids[u] == kIds.cls || p.input_ids[u] == kIds.sep) EXPECT_EQ(label, -100) << "specials never masked";
    }
  }
  EXPECT_GT(masked, 8 * 29 * 0.15);
  EXPECT_LT(masked, 8 * 29 * 0.45);
}

TEST(SopSource, DeterministicPerSeedEpochAndSampleWhateverTheBatch) {
  const auto ds = TokenBlockDataset::from_token_stream(stream(64 * 29), kIds.cls, kIds.sep, 31);
  const auto coll = collator();
  const std::vector<int64_t> subset = {5, 9, 12, 20, 33, 41, 50, 63};
  const SopBatchSource a(ds, subset, coll, 99, SopOptions{32, {}}), again(ds, subset, coll, 99, SopOptions{32, {}});
  const SopBatchSource other_seed(ds, subset, coll, 100, SopOptions{32, {}});
  const Batch x = a.make_batch({0, 1, 2, 3, 4, 5, 6, 7}, 0);
  const Batch y = again.make_batch({0, 1, 2, 3, 4, 5, 6, 7}, 0);
  for (const auto& [key, t] : x.tensors) EXPECT_TRUE(torch::equal(t, y.at(key))) << key;
  // A sample is the same alone or in another batch, at another position.
  const Batch alone = a.make_batch({5}, 0);
  for (const auto& [key, t] : alone.tensors) EXPECT_TRUE(torch::equal(t[0], x.at(key)[5])) << key;
  // Another seed or epoch: other splits, swaps and masks.
  const Batch z = other_seed.make_batch({0, 1, 2, 3, 4, 5, 6, 7}, 0);
  const Batch e = a.make_batch({0, 1, 2, 3, 4, 5, 6, 7}, 1);
  EXPECT_FALSE(torch::equal(x.at("input_ids"), z.at("input_ids")));
  EXPECT_FALSE(torch::equal(x.at("input_ids"), e.at("input_ids")));
  // The label and split of a sample depend on its dataset index (keyed like the masking).
  const SopBatchSource whole(ds, [] {
    std::vector<int64_t> v(64);
    for (int64_t i = 0; i < 64; ++i) v[static_cast<size_t>(i)] = i;
    return v;
  }(), coll, 99, SopOptions{32, {}});
  const Batch w = whole.make_batch({12}, 0);
  EXPECT_TRUE(torch::equal(w.at("input_ids")[0], x.at("input_ids")[2]));
}

TEST(SopSource, LongBlocksAreCutAndBadLengthsRefused) {
  const auto ds = TokenBlockDataset::from_token_stream(stream(10 * 98), kIds.cls, kIds.sep, 100);
  const auto coll = collator();
  const SopBatchSource src(ds, all_indices(ds.size()), coll, 1, SopOptions{40, {}});
  const SopPair p = src.make_pair(3, 0);
  EXPECT_EQ(p.input_ids.size(), 40u);
  EXPECT_EQ(src.make_batch({0, 1}, 0).at("input_ids").size(1), 40);
  EXPECT_THROW(SopBatchSource(ds, all_indices(ds.size()), coll, 1, SopOptions{4, {}}), InputError);
  // A block of one text token cannot be split.
  const auto tiny = TokenBlockDataset::from_token_stream(stream(8), kIds.cls, kIds.sep, 3);
  const SopBatchSource t(tiny, all_indices(tiny.size()), coll, 1, SopOptions{16, {}});
  EXPECT_THROW(t.make_pair(0, 0), InputError);
}

}  // namespace
}  // namespace polytrain
