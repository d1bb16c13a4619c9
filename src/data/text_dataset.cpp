// TokenBlockDataset: file reading, paragraph splitting, block packing; split_train_eval.
// Paragraphs are tokenized one at a time (a tokenizer's cost is per word, so this is linear);
// nothing is cached on disk: Moby Dick + Sherlock tokenize in well under a few seconds.
#include "polytrain/data/text_dataset.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/data/wordpiece.h"

namespace polytrain {
namespace {

constexpr uint64_t kSplitDomain = 0x73706C6974657631ULL;  // "splitev1"

std::string read_text_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  PT_INPUT_CHECK(fs::exists(path, ec), "data file '", path, "' does not exist");
  PT_INPUT_CHECK(fs::is_regular_file(path, ec), "data file '", path, "' is not a regular file");
  std::ifstream in(path, std::ios::binary);
  PT_INPUT_CHECK(in.good(), "cannot open data file '", path, "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  PT_INPUT_CHECK(!in.bad(), "error reading data file '", path, "'");
  PT_INPUT_CHECK(text.find_first_not_of(" \t\r\n\f\v") != std::string::npos, "data file '",
                 path, "' is empty");
  return text;
}

bool is_blank(const char* b, const char* e) {
  for (; b != e; ++b)
    if (*b != ' ' && *b != '\t' && *b != '\r' && *b != '\f' && *b != '\v') return false;
  return true;
}

/// Calls fn(paragraph) for each blank-line separated paragraph, lines joined by one space.
template <typename Fn>
void for_each_paragraph(const std::string& text, Fn&& fn) {
  std::string para;
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    const char* nl = std::find(p, end, '\n');
    const char* line_end = nl;
    if (line_end > p && line_end[-1] == '\r') --line_end;  // CRLF files
    if (is_blank(p, line_end)) {
      if (!para.empty()) fn(para);
      para.clear();
    } else {
      if (!para.empty()) para.push_back(' ');
      para.append(p, line_end);
    }
    p = nl == end ? end : nl + 1;
  }
  if (!para.empty()) fn(para);
}

}  // namespace

TokenBlockDataset TokenBlockDataset::build(const std::vector<std::string>& files,
                                           const WordPieceTokenizer& tok,
                                           int64_t max_seq_length) {
  PT_INPUT_CHECK(tok.cls_id() >= 0 && tok.sep_id() >= 0,
                 "the vocabulary lacks [CLS] or [SEP], needed around each block");
  return build(
      files, [&tok](const std::string& para) { return tok.encode(para, false); }, tok.cls_id(),
      tok.sep_id(), max_seq_length);
}

TokenBlockDataset TokenBlockDataset::build(const std::vector<std::string>& files,
                                           const EncodeFn& encode, int64_t cls_id,
                                           int64_t sep_id, int64_t max_seq_length) {
  PT_INPUT_CHECK(!files.empty(), "data.train_files is empty");
  PT_INPUT_CHECK(max_seq_length >= 3, "data.max_seq_length must be at least 3, got ",
                 max_seq_length);
  std::vector<int64_t> stream;
  for (const auto& path : files) {
    const std::string text = read_text_file(path);
    stream.reserve(stream.size() + text.size() / 4);
    for_each_paragraph(text, [&](const std::string& para) {
      const std::vector<int64_t> ids = encode(para);
      stream.insert(stream.end(), ids.begin(), ids.end());
    });
  }
  const int64_t specials = (cls_id >= 0) + (sep_id >= 0);
  const int64_t block = max_seq_length - specials;
  if (static_cast<int64_t>(stream.size()) < block) {
    std::string names;
    for (const auto& f : files) names += (names.empty() ? "'" : ", '") + f + "'";
    throw InputError(detail::cat("data files ", names, " hold ", stream.size(),
                                 " tokens, fewer than one block of ", block,
                                 specials ? detail::cat(" (max_seq_length - ", specials, ")") : std::string()));
  }
  return from_token_stream(stream, cls_id, sep_id, max_seq_length);
}

TokenBlockDataset TokenBlockDataset::from_token_stream(const std::vector<int64_t>& stream,
                                                       int64_t cls_id, int64_t sep_id,
                                                       int64_t max_seq_length) {
  PT_INPUT_CHECK(max_seq_length >= 3, "data.max_seq_length must be at least 3, got ",
                 max_seq_length);
  TokenBlockDataset ds;
  ds.seq_length_ = max_seq_length;
  ds.num_tokens_ = static_cast<int64_t>(stream.size());
  const int64_t block = max_seq_length - (cls_id >= 0) - (sep_id >= 0);
  const int64_t n = ds.num_tokens_ / block;
  ds.samples_.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> s;
    s.reserve(static_cast<size_t>(max_seq_length));
    if (cls_id >= 0) s.push_back(cls_id);
    s.insert(s.end(), stream.begin() + i * block, stream.begin() + (i + 1) * block);
    if (sep_id >= 0) s.push_back(sep_id);
    ds.samples_.push_back(std::move(s));
  }
  return ds;
}

TokenBlockDataset::Gathered TokenBlockDataset::gather(const std::vector<int64_t>& subset,
                                                      const std::vector<int64_t>& indices) const {
  Gathered out;
  out.samples.reserve(indices.size());
  out.dataset_indices.reserve(indices.size());
  const auto n = static_cast<int64_t>(subset.size());
  for (int64_t i : indices) {
    PT_CHECK(i >= 0 && i < n, "sample index ", i, " out of range ", n);
    const int64_t g = subset[static_cast<size_t>(i)];
    out.samples.push_back(&sample(g));
    out.dataset_indices.push_back(g);
  }
  return out;
}

const std::vector<int64_t>& TokenBlockDataset::sample(int64_t i) const {
  PT_CHECK(i >= 0 && i < size(), "sample index ", i, " outside [0, ", size(), ")");
  return samples_[static_cast<size_t>(i)];
}

DataSplit split_train_eval(int64_t n, double eval_fraction, uint64_t seed) {
  PT_INPUT_CHECK(eval_fraction >= 0.0 && eval_fraction < 1.0,
                 "data.eval_fraction must be in [0, 1), got ", eval_fraction);
  PT_CHECK(n >= 0, "negative dataset size ", n);
  int64_t n_eval = 0;
  if (eval_fraction > 0.0 && n > 1) {
    // The epsilon keeps e.g. 100 * 0.05 = 5.000000000000001 from rounding up to 6.
    n_eval = static_cast<int64_t>(std::ceil(static_cast<double>(n) * eval_fraction - 1e-9));
    n_eval = std::min(std::max<int64_t>(n_eval, 1), n - 1);
  }
  const std::vector<int64_t> perm = epoch_permutation(n, mix_seed(seed, kSplitDomain), 0);
  DataSplit split;
  split.eval.assign(perm.begin(), perm.begin() + n_eval);
  split.train.assign(perm.begin() + n_eval, perm.end());
  std::sort(split.eval.begin(), split.eval.end());
  std::sort(split.train.begin(), split.train.end());
  return split;
}

}  // namespace polytrain
