// Tests of the MLM data pipeline: sample order RNG, train/eval split, masking statistics and
// determinism of MlmCollator (plain and whole-word), TokenBlockDataset packing and errors.
// The real-corpus test needs scripts/fetch_assets.sh (skipped otherwise); tokenizer
// behaviour itself is tested in test_wordpiece.cpp.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include "polytrain/common/error.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/data/text_dataset.h"
#include "polytrain/data/wordpiece.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

// A toy vocabulary: 0 [PAD], 1 [UNK], 2 [CLS], 3 [SEP], 4 [MASK]; 5..kVocab-1 ordinary, of
// which ids >= kFirstCont are ## continuation pieces.
constexpr int64_t kVocab = 1000;
constexpr int64_t kFirstCont = 600;
const MlmSpecialIds kIds{0, 2, 3, 4, 1, kVocab};

std::vector<bool> special_table() {
  std::vector<bool> t(kVocab, false);
  for (int i = 0; i < 5; ++i) t[i] = true;
  return t;
}
std::vector<bool> continuation_table() {
  std::vector<bool> t(kVocab, false);
  for (int64_t i = kFirstCont; i < kVocab; ++i) t[i] = true;
  return t;
}

/// n samples of length len: [CLS] random ids (words of 1-3 pieces, some [UNK]) [SEP].
std::vector<std::vector<int64_t>> make_samples(int64_t n, int64_t len, uint64_t seed) {
  std::vector<std::vector<int64_t>> out;
  CounterRng rng(seed);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> s{kIds.cls};
    while (static_cast<int64_t>(s.size()) < len - 1) {
      if (rng.bounded(50) == 0) { s.push_back(kIds.unk); continue; }
      const bool cont = !s.empty() && s.back() != kIds.cls && rng.bounded(3) == 0;
      s.push_back(cont ? kFirstCont + static_cast<int64_t>(rng.bounded(kVocab - kFirstCont))
                       : 5 + static_cast<int64_t>(rng.bounded(kFirstCont - 5)));
    }
    s.push_back(kIds.sep);
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<const std::vector<int64_t>*> ptrs(const std::vector<std::vector<int64_t>>& v) {
  std::vector<const std::vector<int64_t>*> p;
  for (const auto& s : v) p.push_back(&s);
  return p;
}

std::vector<int64_t> row(const at::Tensor& t, int64_t i) {
  at::Tensor r = t[i].contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

// ---- sample order ------------------------------------------------------------------------

TEST(SampleOrder, PermutationDependsOnlyOnSeedAndEpoch) {
  auto p = epoch_permutation(1000, 42, 3);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(p, epoch_permutation(1000, 42, 3));
  EXPECT_NE(p, epoch_permutation(1000, 42, 4));
  EXPECT_NE(p, epoch_permutation(1000, 43, 3));
  EXPECT_TRUE(epoch_permutation(0, 1, 0).empty());
  EXPECT_EQ(epoch_permutation(1, 1, 0), std::vector<int64_t>{0});
}

TEST(SampleOrder, GoldenValuesArePortable) {
  // Pinned outputs: any change to the generator changes every run's data order and masks.
  EXPECT_EQ(mix_seed(0, 0), 0x3e4e44b4a926063cULL);
  EXPECT_EQ(epoch_permutation(10, 1234, 0), (std::vector<int64_t>{3, 4, 0, 1, 6, 9, 2, 8, 5, 7}));
}

TEST(SampleOrder, BoundedIsUniform) {
  CounterRng rng(mix_seed(7, 1));
  std::vector<int64_t> counts(3, 0);
  for (int i = 0; i < 30000; ++i) {
    const uint64_t v = rng.bounded(3);
    ASSERT_LT(v, 3u);
    ++counts[v];
  }
  for (int64_t c : counts) EXPECT_NEAR(c, 10000, 400);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = rng.next_double();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
  EXPECT_NE(mix_seed(1, 2, 3), mix_seed(1, 3, 2));
}

TEST(Split, DeterministicDisjointAndComplete) {
  const auto s = split_train_eval(1000, 0.05, 9);
  EXPECT_EQ(s.eval.size(), 50u);
  EXPECT_EQ(s.train.size(), 950u);
  std::set<int64_t> all(s.train.begin(), s.train.end());
  for (int64_t e : s.eval) EXPECT_TRUE(all.insert(e).second) << "index in both parts: " << e;
  EXPECT_EQ(all.size(), 1000u);
  const auto again = split_train_eval(1000, 0.05, 9);
  EXPECT_EQ(s.train, again.train);
  EXPECT_EQ(s.eval, again.eval);
  EXPECT_NE(s.eval, split_train_eval(1000, 0.05, 10).eval);
  EXPECT_EQ(split_train_eval(10, 0.01, 1).eval.size(), 1u);  // at least one eval block
  EXPECT_EQ(split_train_eval(2, 0.9, 1).train.size(), 1u);   // at least one train block
  EXPECT_TRUE(split_train_eval(1, 0.5, 1).eval.empty());
  EXPECT_TRUE(split_train_eval(100, 0.0, 1).eval.empty());
  EXPECT_THROW(split_train_eval(100, 1.0, 1), InputError);
}

// ---- masking -----------------------------------------------------------------------------

struct Counts {
  int64_t candidates = 0, selected = 0, to_mask = 0, to_random = 0, kept = 0;
};

/// Collates `samples` in batches of 32 and checks every invariant; returns counts.
Counts collate_and_check(const MlmCollator& coll, const std::vector<std::vector<int64_t>>& samples,
                         int64_t epoch, bool whole_word) {
  const auto special = special_table();
  const auto cont = continuation_table();
  Counts c;
  for (size_t start = 0; start < samples.size(); start += 32) {
    std::vector<const std::vector<int64_t>*> batch;
    std::vector<int64_t> gidx;
    for (size_t i = start; i < std::min(samples.size(), start + 32); ++i) {
      batch.push_back(&samples[i]);
      gidx.push_back(static_cast<int64_t>(i));
    }
    const Batch b = coll.collate(batch, gidx, epoch, 1234);
    const at::Tensor in = b.at("input_ids"), lab = b.at("labels");
    EXPECT_EQ(b.at("token_type_ids").sum().item<int64_t>(), 0);
    EXPECT_EQ(b.at("attention_mask").sum().item<int64_t>(), in.numel());
    for (int64_t r = 0; r < in.size(0); ++r) {
      const auto& orig = *batch[r];
      const auto ids = row(in, r), labels = row(lab, r);
      bool word_selected = false;
      for (size_t p = 0; p < orig.size(); ++p) {
        const int64_t o = orig[p];
        if (special[o]) {
          EXPECT_EQ(labels[p], -100) << "special token labelled";
          EXPECT_EQ(ids[p], o) << "special token changed";
          continue;
        }
        ++c.candidates;
        const bool sel = labels[p] != -100;
        if (whole_word) {
          const bool continues = p > 0 && cont[o] && !special[orig[p - 1]];
          if (continues) {
            EXPECT_EQ(sel, word_selected) << "word masked in part, position " << p;
          } else {
            word_selected = sel;
          }
        }
        if (!sel) {
          EXPECT_EQ(ids[p], o) << "unselected token changed";
          continue;
        }
        EXPECT_EQ(labels[p], o) << "label is not the original id";
        ++c.selected;
        if (ids[p] == kIds.mask) {
          ++c.to_mask;
        } else if (ids[p] == o) {
          ++c.kept;  // includes the rare random draw of the original id
        } else {
          EXPECT_FALSE(special[ids[p]]) << "random replacement is special: " << ids[p];
          ++c.to_random;
        }
      }
    }
  }
  return c;
}

TEST(MlmCollator, MaskingStatistics) {
  DataConfig cfg;  // 0.15, 0.1 random, 0.1 unchanged
  MlmCollator coll(cfg, kIds, {}, special_table());
  MlmCollator::Stats stats;
  coll.set_stats(&stats);
  const auto samples = make_samples(1640, 128, 11);
  const Counts c = collate_and_check(coll, samples, 0, false);
  ASSERT_GT(c.candidates, 200000);
  const double sel = double(c.selected) / c.candidates;
  const double fm = double(c.to_mask) / c.selected, fr = double(c.to_random) / c.selected,
               fk = double(c.kept) / c.selected;
  std::printf("plain: candidates %lld selected %.4f  mask %.4f random %.4f kept %.4f\n",
              (long long)c.candidates, sel, fm, fr, fk);
  EXPECT_NEAR(sel, 0.15, 0.005);
  EXPECT_NEAR(fm, 0.8, 0.01);
  EXPECT_NEAR(fr, 0.1, 0.01);
  EXPECT_NEAR(fk, 0.1, 0.01);
  EXPECT_EQ(stats.candidates, c.candidates);
  EXPECT_EQ(stats.masked, c.selected);
  EXPECT_EQ(stats.replaced_mask, c.to_mask);
  EXPECT_EQ(stats.replaced_mask + stats.replaced_random + stats.kept, stats.masked);
  EXPECT_NEAR(double(stats.replaced_random), double(c.to_random), 0.01 * c.to_random);
}

TEST(MlmCollator, WholeWordMasksWordsWhole) {
  DataConfig cfg;
  cfg.whole_word_mask = true;
  MlmCollator coll(cfg, kIds, continuation_table(), special_table());
  MlmCollator::Stats stats;
  coll.set_stats(&stats);
  const auto samples = make_samples(1640, 128, 12);
  const Counts c = collate_and_check(coll, samples, 0, true);
  const double sel = double(c.selected) / c.candidates;
  const double fm = double(c.to_mask) / c.selected, fr = double(c.to_random) / c.selected,
               fk = double(c.kept) / c.selected;
  std::printf("whole-word: candidates %lld selected %.4f  mask %.4f random %.4f kept %.4f\n",
              (long long)c.candidates, sel, fm, fr, fk);
  // Words are selected as units, so the token fraction has ~1.5x the variance of plain masking.
  EXPECT_NEAR(sel, 0.15, 0.006);
  EXPECT_NEAR(fm, 0.8, 0.01);
  EXPECT_NEAR(fr, 0.1, 0.01);
  EXPECT_NEAR(fk, 0.1, 0.01);
}

TEST(MlmCollator, DeterministicPerSampleRegardlessOfBatch) {
  DataConfig cfg;
  cfg.mask_prob = 0.3;
  MlmCollator coll(cfg, kIds, {}, special_table());
  const auto samples = make_samples(8, 64, 13);
  // Sample 0 alone with global index 77, then at position 5 of a batch of 8.
  const Batch alone = coll.collate({&samples[0]}, {77}, 2, 99);
  std::vector<const std::vector<int64_t>*> batch;
  std::vector<int64_t> gidx;
  for (int i = 1; i < 8; ++i) {
    batch.push_back(&samples[i]);
    gidx.push_back(100 + i);
  }
  batch.insert(batch.begin() + 5, &samples[0]);
  gidx.insert(gidx.begin() + 5, 77);
  const Batch big = coll.collate(batch, gidx, 2, 99);
  EXPECT_EQ(row(alone.at("input_ids"), 0), row(big.at("input_ids"), 5));
  EXPECT_EQ(row(alone.at("labels"), 0), row(big.at("labels"), 5));
  const Batch again = coll.collate({&samples[0]}, {77}, 2, 99);
  EXPECT_TRUE(torch::equal(alone.at("input_ids"), again.at("input_ids")));
  EXPECT_TRUE(torch::equal(alone.at("labels"), again.at("labels")));
  // Another epoch, global index or seed masks differently.
  for (const Batch& other : {coll.collate({&samples[0]}, {77}, 3, 99),
                             coll.collate({&samples[0]}, {78}, 2, 99),
                             coll.collate({&samples[0]}, {77}, 2, 100)})
    EXPECT_FALSE(torch::equal(alone.at("labels"), other.at("labels")));
}

TEST(MlmCollator, PadsShorterSamples) {
  DataConfig cfg;
  cfg.mask_prob = 1.0;
  MlmCollator coll(cfg, kIds, {}, special_table());
  const std::vector<int64_t> a{2, 10, 11, 12, 3}, b{2, 20, 3};
  const Batch out = coll.collate({&a, &b}, {0, 1}, 0, 1);
  EXPECT_EQ(out.at("input_ids").sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(row(out.at("attention_mask"), 1), (std::vector<int64_t>{1, 1, 1, 0, 0}));
  const auto ids = row(out.at("input_ids"), 1), labels = row(out.at("labels"), 1);
  EXPECT_EQ(ids[3], kIds.pad);
  EXPECT_EQ(ids[4], kIds.pad);
  EXPECT_EQ(labels, (std::vector<int64_t>{-100, 20, -100, -100, -100}));
}

TEST(MlmCollator, RejectsBadConfig) {
  DataConfig cfg;
  cfg.random_replace_prob = 0.6;
  cfg.unmask_replace_prob = 0.6;
  EXPECT_THROW(MlmCollator(cfg, kIds, {}, special_table()), InputError);
  DataConfig wwm;
  wwm.whole_word_mask = true;
  EXPECT_THROW(MlmCollator(wwm, kIds, {}, special_table()), InputError);
}

// ---- TokenBlockDataset -------------------------------------------------------------------

using testing::TempDir;

TEST(TokenBlockDataset, PacksBlocksAndDropsTail) {
  std::vector<int64_t> stream;
  for (int64_t i = 0; i < 23; ++i) stream.push_back(10 + i);
  const auto ds = TokenBlockDataset::from_token_stream(stream, 2, 3, 7);  // blocks of 5
  ASSERT_EQ(ds.size(), 4);
  EXPECT_EQ(ds.sample(0), (std::vector<int64_t>{2, 10, 11, 12, 13, 14, 3}));
  EXPECT_EQ(ds.sample(3), (std::vector<int64_t>{2, 25, 26, 27, 28, 29, 3}));
  EXPECT_EQ(ds.num_tokens(), 23);
}

TEST(TokenBlockDataset, SplitsParagraphsAndJoinsLines) {
  TempDir dir;
  const auto f = dir.write("a.txt", "one two\r\nthree\r\n\r\n  \nfour\nfive six\n\n\nseven");
  std::vector<std::string> paragraphs;
  auto encode = [&](const std::string& para) {
    paragraphs.push_back(para);
    std::vector<int64_t> ids;
    for (char ch : para)
      if (ch == ' ') ids.push_back(5);
    ids.push_back(6);  // one id per word
    return ids;
  };
  const auto ds = TokenBlockDataset::build({f}, encode, 2, 3, 4);
  EXPECT_EQ(paragraphs, (std::vector<std::string>{"one two three", "four five six", "seven"}));
  EXPECT_EQ(ds.num_tokens(), 7);
  EXPECT_EQ(ds.size(), 3);
}

TEST(TokenBlockDataset, InputErrorNamesTheFile) {
  TempDir dir;
  auto encode = [](const std::string&) { return std::vector<int64_t>{7, 7, 7}; };
  const std::string missing = dir.str("no_such_file.txt");
  try {
    TokenBlockDataset::build({missing}, encode, 2, 3, 8);
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const auto empty = dir.write("empty.txt", "\n \n");
  try {
    TokenBlockDataset::build({empty}, encode, 2, 3, 8);
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(empty), std::string::npos) << e.what();
  }
  const auto small = dir.write("small.txt", "tiny");
  EXPECT_THROW(TokenBlockDataset::build({small}, encode, 2, 3, 8), InputError);
}

TEST(TokenBlockDataset, BuildsWithWordPieceTokenizer) {
  TempDir dir;
  const WordPieceTokenizer tok({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "white",
                                "whale", "moby", "dick", "##s", ".", ","});
  const auto f = dir.write("moby.txt", "The white\nwhale.\n\nMoby Dick, the whales.\n");
  // Stream: the white whale . moby dick , the whale ##s .  (11 tokens, blocks of 3)
  const auto ds = TokenBlockDataset::build({f}, tok, 5);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.num_tokens(), 11);
  EXPECT_EQ(tok.decode(ds.sample(0)), "[CLS] the white whale [SEP]");
  EXPECT_EQ(tok.decode(ds.sample(1)), "[CLS] . moby dick [SEP]");
  EXPECT_EQ(tok.decode(ds.sample(2)), "[CLS] , the whale [SEP]");
  EXPECT_THROW(TokenBlockDataset::build({f, dir.str("gone.txt")}, tok, 5), InputError);
}

TEST(TokenBlockDataset, RealCorpusIsFastAndMasksWholeWords) {
  const std::string cache = testing::asset_cache();
  const std::vector<std::string> files{cache + "/corpus/mobydick.txt",
                                       cache + "/corpus/sherlock.txt"};
  const std::string vocab = cache + "/vocab/bert-base-uncased-vocab.txt";
  for (const auto& f : {files[0], files[1], vocab})
    PT_SKIP_UNLESS(std::ifstream(f), f << " (scripts/fetch_assets.sh)");
  const auto tok = WordPieceTokenizer::from_vocab_file(vocab);
  const auto t0 = std::chrono::steady_clock::now();
  const auto ds = TokenBlockDataset::build(files, tok, 128);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("real corpus: %lld tokens -> %lld blocks of 128 in %.2f s\n",
              (long long)ds.num_tokens(), (long long)ds.size(), secs);
  EXPECT_LT(secs, 5.0);  // generous: a loaded 2-core machine; typically well under 1 s
  ASSERT_GT(ds.size(), 3000);
  for (int64_t i : {int64_t{0}, ds.size() - 1}) {
    ASSERT_EQ(ds.sample(i).size(), 128u);
    EXPECT_EQ(ds.sample(i).front(), tok.cls_id());
    EXPECT_EQ(ds.sample(i).back(), tok.sep_id());
  }
  // Whole-word masking with the tokenizer's tables on real text.
  std::vector<bool> cont(tok.vocab_size()), special(tok.vocab_size());
  for (int64_t id = 0; id < tok.vocab_size(); ++id) {
    cont[id] = tok.is_continuation(id);
    special[id] = tok.is_special(id);
  }
  DataConfig cfg;
  cfg.whole_word_mask = true;
  MlmCollator coll(cfg, {tok.pad_id(), tok.cls_id(), tok.sep_id(), tok.mask_id(), tok.unk_id(),
                         tok.vocab_size()},
                   cont, special);
  MlmCollator::Stats stats;
  coll.set_stats(&stats);
  std::vector<const std::vector<int64_t>*> batch;
  std::vector<int64_t> gidx;
  for (int64_t i = 0; i < 256; ++i) {
    batch.push_back(&ds.sample(i));
    gidx.push_back(i);
  }
  const Batch b = coll.collate(batch, gidx, 0, 1234);
  int64_t split_words = 0;
  for (int64_t r = 0; r < 256; ++r) {
    const auto labels = row(b.at("labels"), r);
    const auto& orig = *batch[r];
    for (size_t p = 2; p + 1 < orig.size(); ++p)
      if (cont[orig[p]] && (labels[p] != -100) != (labels[p - 1] != -100)) ++split_words;
  }
  EXPECT_EQ(split_words, 0);
  EXPECT_NEAR(double(stats.masked) / stats.candidates, 0.15, 0.01);
}

}  // namespace
}  // namespace polytrain
