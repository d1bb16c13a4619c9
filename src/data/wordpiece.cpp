// WordPieceTokenizer: UTF-8 decoding, BertNormalizer + BertPreTokenizer over the generated
// Unicode tables (data/unicode_tables.cpp), and the greedy WordPiece model. Mirrors HF
// tokenizers (normalizers/bert.rs, pre_tokenizers/bert.rs, models/wordpiece); no ICU needed.
#include "polytrain/data/wordpiece.h"

#include <algorithm>
#include <fstream>

#include "polytrain/common/error.h"
#include "polytrain/data/tokenizer_file.h"
#include "polytrain/data/unicode_tables.h"
#include "polytrain/data/utf8.h"

namespace polytrain {

namespace {

namespace ut = unicode_tables;

const char* const kSpecialTokens[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};

bool in_ranges(char32_t c, const ut::Range* ranges, size_t n) {
  const ut::Range* end = ranges + n;
  // First range whose last >= c; ranges are sorted and disjoint.
  const ut::Range* it =
      std::lower_bound(ranges, end, c, [](const ut::Range& r, char32_t v) { return r.last < v; });
  return it != end && it->first <= c;
}

bool is_control(char32_t c) { return in_ranges(c, ut::kControl, ut::kControlSize); }
bool is_whitespace(char32_t c) { return in_ranges(c, ut::kWhitespace, ut::kWhitespaceSize); }
bool is_cjk(char32_t c) { return in_ranges(c, ut::kCjk, ut::kCjkSize); }
bool is_stripped(char32_t c) { return in_ranges(c, ut::kStripped, ut::kStrippedSize); }
bool is_punctuation(char32_t c) { return in_ranges(c, ut::kPunctuation, ut::kPunctuationSize); }

// Appends c after NFD, dropping non-spacing marks, and lowercasing (strip_accents + lowercase).
void append_folded(char32_t c, std::u32string& out) {
  // Hangul syllables: the algorithmic canonical decomposition of Unicode ch. 3.12.
  constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
  constexpr char32_t kVCount = 21, kTCount = 28, kSCount = 19 * 21 * 28;
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / (kVCount * kTCount));
    out.push_back(kVBase + (s % (kVCount * kTCount)) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (is_stripped(c)) return;
  const ut::Fold* end = ut::kFolds + ut::kFoldsSize;
  const ut::Fold* it =
      std::lower_bound(ut::kFolds, end, c, [](const ut::Fold& f, char32_t v) { return f.cp < v; });
  if (it != end && it->cp == c)
    out.append(ut::kFoldPool + it->offset, it->length);
  else
    out.push_back(c);
}

bool is_utf8_continuation_byte(char b) { return (static_cast<unsigned char>(b) & 0xC0) == 0x80; }

}  // namespace

WordPieceTokenizer WordPieceTokenizer::from_vocab_file(const std::string& path, std::string_view key) {
  using K = TokenizerFileKind;
  // Read line by line, another tokenizer's file would fail late and vaguely ("no [UNK]").
  const std::string other = refused_tokenizer_file(
      path, {K::kJson, K::kSentencePieceModel, K::kBinary, K::kBpeMerges, K::kSentencePieceVocab, K::kPlainText});
  PT_INPUT_CHECK(other.empty(), key, " '", path, "' is ", other,
                 "; train_bert and train_albert need a WordPiece vocab.txt (one token per line, like "
                 "bert-base-uncased's)");
  std::ifstream in(path, std::ios::binary);
  PT_INPUT_CHECK(in, key, " '", path, "' cannot be read (a WordPiece vocab.txt)");
  std::vector<std::string> vocab;
  std::unordered_map<std::string, size_t> first_line;
  std::string line;
  while (std::getline(in, line)) {
    // HF reads each line with trailing whitespace trimmed.
    while (!line.empty() && std::string_view(" \t\r\v\f").find(line.back()) != std::string_view::npos)
      line.pop_back();
    const size_t line_no = vocab.size() + 1;
    PT_INPUT_CHECK(!line.empty(), "vocab file '", path, "': empty token at line ", line_no);
    auto [it, inserted] = first_line.emplace(line, line_no);
    PT_INPUT_CHECK(inserted, "vocab file '", path, "': duplicate token '", line, "' at line ",
                   line_no, " (first at line ", it->second, ")");
    vocab.push_back(line);
  }
  PT_INPUT_CHECK(!vocab.empty(), "vocab file '", path, "' is empty");
  try {
    return WordPieceTokenizer(std::move(vocab));
  } catch (const InputError& e) {
    throw InputError("vocab file '" + path + "': " + e.what());
  }
}

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> vocab, bool lowercase)
    : vocab_(std::move(vocab)), lowercase_(lowercase) {
  PT_INPUT_CHECK(!vocab_.empty(), "empty WordPiece vocab");
  ids_.reserve(vocab_.size());
  for (size_t i = 0; i < vocab_.size(); ++i) {
    PT_INPUT_CHECK(!vocab_[i].empty(), "empty token at index ", i);
    auto [it, inserted] = ids_.emplace(vocab_[i], static_cast<int64_t>(i));
    PT_INPUT_CHECK(inserted, "duplicate token '", vocab_[i], "' at index ", i, " (first at index ",
                   it->second, ")");
    max_token_bytes_ = std::max(max_token_bytes_, vocab_[i].size());
  }
  pad_id_ = token_to_id("[PAD]");
  unk_id_ = token_to_id("[UNK]");
  cls_id_ = token_to_id("[CLS]");
  sep_id_ = token_to_id("[SEP]");
  mask_id_ = token_to_id("[MASK]");
  PT_INPUT_CHECK(unk_id_ >= 0, "WordPiece vocab has no [UNK] token");
  for (const char* token : kSpecialTokens)
    if (int64_t id = token_to_id(token); id >= 0) special_ids_.push_back(id);
}

std::vector<int64_t> WordPieceTokenizer::encode(const std::string& text,
                                                bool add_special_tokens) const {
  std::vector<int64_t> ids;
  if (add_special_tokens) {
    PT_INPUT_CHECK(cls_id_ >= 0 && sep_id_ >= 0, "WordPiece vocab lacks [CLS] or [SEP]");
    ids.push_back(cls_id_);
  }
  // Special tokens are matched in the raw text, before any normalization (HF added tokens
  // with normalized=false); the stretches between them are tokenized on their own.
  size_t plain_start = 0, pos = 0;
  while ((pos = text.find('[', pos)) != std::string::npos) {
    int64_t match = -1;
    for (int64_t id : special_ids_)
      if (text.compare(pos, vocab_[id].size(), vocab_[id]) == 0) match = id;
    if (match < 0) {
      ++pos;
      continue;
    }
    encode_plain(std::string_view(text).substr(plain_start, pos - plain_start), ids);
    ids.push_back(match);
    pos += vocab_[match].size();
    plain_start = pos;
  }
  encode_plain(std::string_view(text).substr(plain_start), ids);
  if (add_special_tokens) ids.push_back(sep_id_);
  return ids;
}

void WordPieceTokenizer::encode_plain(std::string_view text, std::vector<int64_t>& ids) const {
  // BertNormalizer, one code point at a time.
  std::u32string normalized;
  for (char32_t c : decode_utf8(text)) {
    if (is_control(c)) continue;
    if (is_whitespace(c)) {
      normalized.push_back(U' ');
    } else if (is_cjk(c)) {
      normalized.push_back(U' ');
      lowercase_ ? append_folded(c, normalized) : normalized.push_back(c);
      normalized.push_back(U' ');
    } else {
      lowercase_ ? append_folded(c, normalized) : normalized.push_back(c);
    }
  }
  // BertPreTokenizer: whitespace ends a word, each punctuation char is a word by itself.
  std::string word;
  size_t word_chars = 0;
  auto flush = [&] {
    if (word_chars > 0) encode_word(word, word_chars, ids);
    word.clear();
    word_chars = 0;
  };
  for (char32_t c : normalized) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      append_utf8(c, word);
      word_chars = 1;
      flush();
    } else {
      append_utf8(c, word);
      ++word_chars;
    }
  }
  flush();
}

void WordPieceTokenizer::encode_word(const std::string& word, size_t num_chars,
                                     std::vector<int64_t>& ids) const {
  if (num_chars > kMaxInputCharsPerWord) {
    ids.push_back(unk_id_);
    return;
  }
  const size_t first_piece = ids.size();
  std::string candidate;
  size_t start = 0;
  while (start < word.size()) {
    const std::string_view prefix = start > 0 ? "##" : "";
    // No token is longer than max_token_bytes_, so start the search there (on a char boundary).
    size_t end = std::min(word.size(), start + max_token_bytes_ - std::min(max_token_bytes_, prefix.size()));
    while (end < word.size() && is_utf8_continuation_byte(word[end])) --end;
    int64_t found = -1;
    while (end > start) {
      candidate.assign(prefix);
      candidate.append(word, start, end - start);
      if (auto it = ids_.find(candidate); it != ids_.end()) {
        found = it->second;
        break;
      }
      do --end; while (end > start && is_utf8_continuation_byte(word[end]));
    }
    if (found < 0) {  // some part matches nothing: the whole word is unknown
      ids.resize(first_piece);
      ids.push_back(unk_id_);
      return;
    }
    ids.push_back(found);
    start = end;
  }
}

std::vector<std::string> WordPieceTokenizer::tokenize(const std::string& text) const {
  std::vector<std::string> tokens;
  for (int64_t id : encode(text)) tokens.push_back(vocab_[id]);
  return tokens;
}

std::string WordPieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string& token = id_to_token(ids[i]);
    if (i > 0 && is_continuation(ids[i])) {
      out.append(token, 2, std::string::npos);
    } else {
      if (i > 0) out.push_back(' ');
      out += token;
    }
  }
  return out;
}

const std::string& WordPieceTokenizer::id_to_token(int64_t id) const {
  PT_INPUT_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocab [0, ",
                 vocab_size(), ")");
  return vocab_[id];
}

int64_t WordPieceTokenizer::token_to_id(const std::string& token) const {
  auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

bool WordPieceTokenizer::is_continuation(int64_t id) const {
  return id_to_token(id).compare(0, 2, "##") == 0;
}

bool WordPieceTokenizer::is_special(int64_t id) const {
  return std::find(special_ids_.begin(), special_ids_.end(), id) != special_ids_.end();
}

}  // namespace polytrain
