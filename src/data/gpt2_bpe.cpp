// Gpt2BpeTokenizer: GPT-2's pre-tokenization pattern through PCRE2 (Unicode letter and number
// classes and the (?!\S) lookahead need a real regex engine; std::regex has neither), OpenAI's
// bytes_to_unicode map, and rank-ordered BPE merges over token ids.
#include "polytrain/data/gpt2_bpe.h"

#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "polytrain/common/error.h"
#include "polytrain/data/tokenizer_file.h"
#include "polytrain/data/utf8.h"

#if POLYTRAIN_WITH_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

namespace polytrain {

namespace {

using detail::cat;

constexpr const char* kPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// OpenAI's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// for U+0100.. in byte order, so every byte is a visible character in encoder.json.
std::vector<char32_t> byte_to_unicode() {
  std::vector<char32_t> map(256);
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  PT_INPUT_CHECK(f.good(), what, " '", path, "' cannot be read");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

constexpr const char* kNeedsEncoder =
    "train_gpt2 needs GPT-2's encoder.json (a JSON object of token -> id), with vocab.bpe beside it or --merges";

// A file of another tokenizer is named as such before its parser trips over it.
void check_file_kinds(const std::string& encoder_json, const std::string& merges_bpe, std::string_view key) {
  using K = TokenizerFileKind;
  const std::string enc = refused_tokenizer_file(
      encoder_json, {K::kEmpty, K::kSentencePieceModel, K::kBinary, K::kWordPieceVocab, K::kBpeMerges,
                     K::kSentencePieceVocab, K::kPlainText});
  PT_INPUT_CHECK(enc.empty(), key, " '", encoder_json, "' is ", enc, "; ", kNeedsEncoder);
  // Plain text and an empty file pass: the line parser names the line, or says "no merges".
  const std::string merges = refused_tokenizer_file(
      merges_bpe, {K::kJson, K::kSentencePieceModel, K::kBinary, K::kWordPieceVocab, K::kSentencePieceVocab});
  PT_INPUT_CHECK(merges.empty(), "merges file '", merges_bpe, "' is ", merges,
                 "; train_gpt2 needs GPT-2's vocab.bpe (two tokens per line) beside ", key, ", or --merges");
}

#if POLYTRAIN_WITH_PCRE2
struct Pattern {
  pcre2_code* code = nullptr;
  Pattern() {
    int err = 0;
    PCRE2_SIZE off = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                         &off, nullptr);
    PT_CHECK(code != nullptr, "GPT-2 pattern does not compile in PCRE2 (error ", err, " at ", off, ")");
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional: the interpreter is used without JIT
  }
  ~Pattern() { pcre2_code_free(code); }
};
#endif

}  // namespace

bool Gpt2BpeTokenizer::available() { return POLYTRAIN_WITH_PCRE2 != 0; }

std::vector<std::string> Gpt2BpeTokenizer::pretokenize(std::string_view raw) {
#if POLYTRAIN_WITH_PCRE2
  static const Pattern pattern;
  const std::string text = sanitize_utf8(raw);
  std::vector<std::string> pieces;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(pattern.code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start < text.size()) {
    const int rc = pcre2_match(pattern.code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;  // cannot happen: every character matches one alternative
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] <= start) break;
    pieces.emplace_back(text, ov[0], ov[1] - ov[0]);
    start = ov[1];
  }
  pcre2_match_data_free(md);
  return pieces;
#else
  (void)raw;
  throw InputError("the GPT-2 BPE tokenizer is not in this build (it needs PCRE2: install libpcre2-dev and rebuild)");
#endif
}

Gpt2BpeTokenizer Gpt2BpeTokenizer::from_files(const std::string& encoder_json, const std::string& merges_bpe,
                                              std::string_view key) {
  check_file_kinds(encoder_json, merges_bpe, key);
  Gpt2BpeTokenizer t;
  const auto b2u = byte_to_unicode();
  std::unordered_map<char32_t, int> u2b;
  for (int b = 0; b < 256; ++b) u2b[b2u[b]] = b;

  nlohmann::json enc;
  try {
    enc = nlohmann::json::parse(read_file(encoder_json, "encoder.json"));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(cat(encoder_json, ": not valid JSON: ", e.what()));
  }
  PT_INPUT_CHECK(enc.is_object() && !enc.empty(), encoder_json, ": expected a JSON object of token -> id");
  PT_INPUT_CHECK(!enc.contains("model") || !enc["model"].is_object(), key, " '", encoder_json,
                 "' is a Hugging Face tokenizer.json; ", kNeedsEncoder, " (vocab.json and merges.txt in a Hugging Face "
                 "gpt2 folder)");
  std::unordered_map<std::string, int64_t> ids;
  t.tokens_.assign(enc.size(), std::string());
  std::vector<bool> seen(enc.size(), false);
  for (const auto& [token, id] : enc.items()) {
    PT_INPUT_CHECK(id.is_number_integer(), encoder_json, ": the id of token '", token, "' is not an integer");
    const auto i = id.get<int64_t>();
    PT_INPUT_CHECK(i >= 0 && i < static_cast<int64_t>(enc.size()) && !seen[i], encoder_json, ": id ", i,
                   " of token '", token, "' is out of range or repeated (ids must be 0..", enc.size() - 1, ")");
    seen[i] = true;
    t.tokens_[i] = token;
    ids.emplace(token, i);
  }
  t.token_bytes_.resize(t.tokens_.size());
  for (size_t i = 0; i < t.tokens_.size(); ++i) {
    for (char32_t c : decode_utf8(t.tokens_[i])) {
      auto it = u2b.find(c);
      PT_INPUT_CHECK(it != u2b.end(), encoder_json, ": token '", t.tokens_[i],
                     "' has a character outside GPT-2's byte alphabet");
      t.token_bytes_[i].push_back(static_cast<char>(it->second));
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    append_utf8(b2u[b], sym);
    auto it = ids.find(sym);
    PT_INPUT_CHECK(it != ids.end(), encoder_json, ": no token for byte ", b, " ('", sym, "')");
    t.byte_id_[b] = it->second;
  }
  if (auto it = ids.find("<|endoftext|>"); it != ids.end()) t.eos_id_ = it->second;

  std::istringstream merges(read_file(merges_bpe, "vocab.bpe"));
  std::string line;
  uint64_t rank = 0;
  for (int64_t lineno = 1; std::getline(merges, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    const auto sp = line.find(' ');
    PT_INPUT_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
                   merges_bpe, ":", lineno, ": expected two tokens separated by one space, got '", line, "'");
    const std::string a = line.substr(0, sp), b = line.substr(sp + 1);
    auto ia = ids.find(a), ib = ids.find(b), iab = ids.find(a + b);
    PT_INPUT_CHECK(ia != ids.end() && ib != ids.end() && iab != ids.end(), merges_bpe, ":", lineno, ": merge '",
                   line, "' uses or makes a token encoder.json lacks");
    const uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint64_t>(ib->second);
    t.merges_.emplace(key, (rank++ << 32) | static_cast<uint64_t>(iab->second));  // first rank wins
  }
  PT_INPUT_CHECK(rank > 0, merges_bpe, ": no merges");
  return t;
}

void Gpt2BpeTokenizer::bpe(std::string_view piece, std::vector<int64_t>& out) const {
  std::vector<int64_t> sym;
  sym.reserve(piece.size());
  for (char c : piece) sym.push_back(byte_id_[static_cast<unsigned char>(c)]);
  const auto key = [](int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); };
  while (sym.size() > 1) {
    // The lowest-ranked adjacent pair; all its occurrences merge, left to right (encoder.py).
    uint64_t best = std::numeric_limits<uint64_t>::max();
    int64_t left = -1, right = -1;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = merges_.find(key(sym[i], sym[i + 1]));
      if (it != merges_.end() && it->second < best) best = it->second, left = sym[i], right = sym[i + 1];
    }
    if (left < 0) break;
    const auto merged = static_cast<int64_t>(best & 0xFFFFFFFFu);
    size_t w = 0;
    for (size_t i = 0; i < sym.size(); ++w) {
      if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
        sym[w] = merged;
        i += 2;
      } else {
        sym[w] = sym[i++];
      }
    }
    sym.resize(w);
  }
  out.insert(out.end(), sym.begin(), sym.end());
}

std::vector<int64_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  for (const auto& piece : pretokenize(text)) bpe(piece, ids);
  return ids;
}

std::string Gpt2BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    id_to_token(id);  // range check
    out += token_bytes_[id];
  }
  return out;
}

const std::string& Gpt2BpeTokenizer::id_to_token(int64_t id) const {
  PT_INPUT_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary [0, ", vocab_size(), ")");
  return tokens_[id];
}

}  // namespace polytrain
