// BERT's WordPiece tokenizer, with the behaviour of Hugging Face's BertTokenizerFast for
// bert-base-uncased: BertNormalizer, BertPreTokenizer, greedy longest-match WordPiece.
// Reading text files and batching ids into tensors are left to datasets and collators.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace polytrain {

/// Text -> WordPiece ids over a fixed vocabulary (one token per line in vocab.txt, id = line).
///
/// Pipeline (as HF tokenizers): special tokens ([PAD] [UNK] [CLS] [SEP] [MASK]) written in the
/// raw text are kept whole; the rest is cleaned (control chars, NUL and U+FFFD removed,
/// whitespace -> ' '), CJK ideographs spaced out, and, when lowercasing, NFD-decomposed with
/// non-spacing marks dropped and lowercased; then split on whitespace and around each
/// punctuation char; each word becomes the longest vocab prefix, then `##`-prefixed longest
/// matches of the rest, or [UNK] when that fails or the word has over 100 code points.
/// Invalid UTF-8 bytes are read as U+FFFD and so dropped.
class WordPieceTokenizer {
 public:
  /// Longer words (in code points, after normalization) become [UNK].
  static constexpr size_t kMaxInputCharsPerWord = 100;

  /// Reads a vocab.txt. InputError naming the file when it is missing or empty, or has an
  /// empty or duplicate token (with its line number), or lacks [UNK]; a file of another
  /// tokenizer (GPT-2's encoder.json, a SentencePiece model) is named as such, with `key` (the
  /// setting that named the file) in the message.
  static WordPieceTokenizer from_vocab_file(const std::string& path, std::string_view key = "data.vocab_file");

  /// vocab[i] is the token of id i. InputError on an empty vocab, an empty or duplicate
  /// token, or no [UNK].
  explicit WordPieceTokenizer(std::vector<std::string> vocab, bool lowercase = true);

  std::vector<std::string> tokenize(const std::string& text) const;
  /// [CLS] ... [SEP] around the ids when add_special_tokens (InputError if the vocab lacks them).
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = false) const;
  /// Tokens joined by spaces; a `##` continuation is glued to the previous token.
  std::string decode(const std::vector<int64_t>& ids) const;

  /// InputError when id is outside [0, vocab_size()).
  const std::string& id_to_token(int64_t id) const;
  /// -1 when absent.
  int64_t token_to_id(const std::string& token) const;
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  bool lowercase() const { return lowercase_; }

  /// Ids of the special tokens; -1 when the vocab lacks one ([UNK] is always present).
  int64_t pad_id() const { return pad_id_; }
  int64_t unk_id() const { return unk_id_; }
  int64_t cls_id() const { return cls_id_; }
  int64_t sep_id() const { return sep_id_; }
  int64_t mask_id() const { return mask_id_; }

  /// The token starts with "##" (it continues the previous token's word).
  bool is_continuation(int64_t id) const;
  /// One of [PAD] [UNK] [CLS] [SEP] [MASK].
  bool is_special(int64_t id) const;

 private:
  // Normalizes and pre-tokenizes text that holds no special token; appends WordPiece ids.
  void encode_plain(std::string_view text, std::vector<int64_t>& ids) const;
  // One pre-tokenized word (UTF-8) -> its pieces, or [UNK].
  void encode_word(const std::string& word, size_t num_chars, std::vector<int64_t>& ids) const;

  std::vector<std::string> vocab_;
  std::unordered_map<std::string, int64_t> ids_;
  bool lowercase_;
  size_t max_token_bytes_ = 0;  // longest token, "##" included: bounds the greedy search
  int64_t pad_id_ = -1, unk_id_ = -1, cls_id_ = -1, sep_id_ = -1, mask_id_ = -1;
  std::vector<int64_t> special_ids_;  // the special tokens present, matched in raw text
};

}  // namespace polytrain
