// Tokenizer file kinds from their first bytes. Why by content: users rename files (a BERT
// vocab saved as encoder.json, spiece.model as vocab.txt), and the loaders' own errors on a
// foreign file ("not valid JSON: parse_error.101", "duplicate token") do not say what it was.
#include "polytrain/data/tokenizer_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

namespace polytrain {

namespace {

// C0 control bytes other than \t \n \v \f \r: no text file has them, every protobuf does
// (field tags 0x0A, 0x12, 0x15, 0x18 and zero bytes of float scores).
bool is_binary(std::string_view head) {
  return std::any_of(head.begin(), head.end(), [](char c) {
    const auto b = static_cast<unsigned char>(c);
    return (b < 0x20 && (b < '\t' || b > '\r')) || b == 0x7F;
  });
}

std::string_view trim_right(std::string_view s) {
  while (!s.empty() && std::string_view(" \t\r\v\f").find(s.back()) != std::string_view::npos) s.remove_suffix(1);
  return s;
}

// Non-empty lines of head, right-trimmed; a cut last line is dropped.
std::vector<std::string_view> sample_lines(std::string_view head, bool truncated) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < head.size()) {
    const size_t nl = head.find('\n', start);
    if (nl == std::string_view::npos && truncated) break;
    const size_t end = nl == std::string_view::npos ? head.size() : nl;
    const std::string_view line = trim_right(head.substr(start, end - start));
    if (!line.empty()) lines.push_back(line);
    start = end + 1;
  }
  return lines;
}

// "piece<TAB>score", as spm_train writes its .vocab.
bool is_piece_score(std::string_view line) {
  const size_t tab = line.find('\t');
  if (tab == 0 || tab == std::string_view::npos || tab + 1 == line.size()) return false;
  const std::string_view score = line.substr(tab + 1);
  return score.find_first_not_of("-+.0123456789eE") == std::string_view::npos;
}

// "a b": two tokens and one space, as in vocab.bpe / merges.txt.
bool is_merge(std::string_view line) {
  const size_t sp = line.find(' ');
  return sp != 0 && sp != std::string_view::npos && sp + 1 < line.size() &&
         line.find_first_of(" \t", sp + 1) == std::string_view::npos && line.find('\t') == std::string_view::npos;
}

TokenizerFileKind sniff_text(std::string_view head, bool truncated) {
  const auto lines = sample_lines(head, truncated);
  if (lines.empty()) return TokenizerFileKind::kEmpty;
  if (lines.front().rfind("#version", 0) == 0) return TokenizerFileKind::kBpeMerges;
  size_t piece_score = 0, merge = 0, word = 0;
  for (const auto line : lines) {
    piece_score += is_piece_score(line);
    merge += is_merge(line);
    word += line.find_first_of(" \t") == std::string_view::npos;
  }
  const size_t n = lines.size();
  if (piece_score == n) return TokenizerFileKind::kSentencePieceVocab;
  if (merge == n) return TokenizerFileKind::kBpeMerges;
  // Most lines one word: a vocab, even with an odd token; most lines with spaces: prose.
  if (2 * word > n) return TokenizerFileKind::kWordPieceVocab;
  return TokenizerFileKind::kPlainText;
}

}  // namespace

TokenizerFileKind sniff_tokenizer_file(std::string_view head, bool truncated) {
  if (head.rfind("\xEF\xBB\xBF", 0) == 0) head.remove_prefix(3);  // UTF-8 BOM
  const size_t first = head.find_first_not_of(" \t\r\n\v\f");
  if (first == std::string_view::npos) return TokenizerFileKind::kEmpty;
  if (is_binary(head)) {
    // ModelProto's field 1 (repeated SentencePiece pieces), length-delimited: tag 0x0A.
    return head[0] == '\x0A' ? TokenizerFileKind::kSentencePieceModel : TokenizerFileKind::kBinary;
  }
  if (head[first] == '{') return TokenizerFileKind::kJson;
  return sniff_text(head, truncated);
}

std::string describe(TokenizerFileKind kind) {
  switch (kind) {
    case TokenizerFileKind::kEmpty: return "empty";
    case TokenizerFileKind::kJson:
      return "a JSON file (like GPT-2's encoder.json, which train_gpt2 reads)";
    case TokenizerFileKind::kSentencePieceModel:
      return "a SentencePiece model (binary protobuf, like T5's spiece.model, which train_t5 reads)";
    case TokenizerFileKind::kBinary: return "a binary file, not a tokenizer vocabulary";
    case TokenizerFileKind::kWordPieceVocab:
      return "a WordPiece vocab.txt (one token per line, like BERT's, which train_bert and train_albert read)";
    case TokenizerFileKind::kBpeMerges:
      return "a BPE merges file (two tokens per line, like GPT-2's vocab.bpe, which train_gpt2 takes beside "
             "encoder.json)";
    case TokenizerFileKind::kSentencePieceVocab:
      return "a SentencePiece .vocab (piece<TAB>score per line; the model is the .model file written beside it)";
    case TokenizerFileKind::kPlainText: return "plain text (lines of words), not a tokenizer vocabulary";
  }
  return "an unknown kind of file";
}

std::string refused_tokenizer_file(const std::string& path, std::initializer_list<TokenizerFileKind> refused) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return "";
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::string head(kTokenizerSniffBytes, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  const bool truncated = head.size() == kTokenizerSniffBytes && in.peek() != std::char_traits<char>::eof();
  const TokenizerFileKind kind = sniff_tokenizer_file(head, truncated);
  return std::find(refused.begin(), refused.end(), kind) == refused.end() ? "" : describe(kind);
}

}  // namespace polytrain
