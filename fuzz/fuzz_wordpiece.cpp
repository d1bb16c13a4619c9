// A WordPiece vocab.txt (the first part of the input) and text to tokenize with it, invalid
// UTF-8 included; the same text through BERT's real vocab when the asset is present.
#include <fuzzer/FuzzedDataProvider.h>

#include <filesystem>
#include <memory>

#include "fuzz_util.h"
#include "polytrain/data/utf8.h"
#include "polytrain/data/wordpiece.h"

using polytrain::WordPieceTokenizer;

namespace {
const WordPieceTokenizer* bert() {
  static std::unique_ptr<WordPieceTokenizer> t = [] {
    const std::string path = std::string(POLYTRAIN_SOURCE_DIR) + "/.cache/assets/vocab/bert-base-uncased-vocab.txt";
    return std::filesystem::exists(path) ? std::make_unique<WordPieceTokenizer>(WordPieceTokenizer::from_vocab_file(path))
                                         : nullptr;
  }();
  return t.get();
}

void check(const WordPieceTokenizer& t, const std::string& text) {
  for (const int64_t id : t.encode(text, true))
    if (id < 0 || id >= t.vocab_size()) __builtin_trap();  // an id outside the vocab
  (void)t.decode(t.encode(text));
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string vocab = in.ConsumeRandomLengthString(4096);
  const std::string text = in.ConsumeRemainingBytesAsString();
  (void)polytrain::decode_utf8(text);
  (void)polytrain::sanitize_utf8(text);
  polytrain::fuzz::expect_value_or_input_error([&] {
    polytrain::fuzz::MemFile f(vocab);
    check(WordPieceTokenizer::from_vocab_file(f.path()), text);
  });
  if (const auto* t = bert()) check(*t, text);
  return 0;
}
