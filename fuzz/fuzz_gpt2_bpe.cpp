// GPT-2's encoder.json and merges (vocab.bpe) from the input, and text to encode with them;
// the same text through the real GPT-2 files when the assets are present.
#include <fuzzer/FuzzedDataProvider.h>

#include <filesystem>
#include <memory>

#include "fuzz_util.h"
#include "polytrain/data/gpt2_bpe.h"

using polytrain::Gpt2BpeTokenizer;

namespace {
const Gpt2BpeTokenizer* gpt2() {
  static std::unique_ptr<Gpt2BpeTokenizer> t = [] {
    const std::string dir = std::string(POLYTRAIN_SOURCE_DIR) + "/.cache/assets/gpt2/";
    return std::filesystem::exists(dir + "encoder.json")
               ? std::make_unique<Gpt2BpeTokenizer>(Gpt2BpeTokenizer::from_files(dir + "encoder.json", dir + "vocab.bpe"))
               : nullptr;
  }();
  return t.get();
}

void check(const Gpt2BpeTokenizer& t, const std::string& text) {
  const auto ids = t.encode(text);
  for (const int64_t id : ids)
    if (id < 0 || id >= t.vocab_size()) __builtin_trap();
  (void)t.decode(ids);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string encoder = in.ConsumeRandomLengthString(8192);
  const std::string merges = in.ConsumeRandomLengthString(4096);
  const std::string text = in.ConsumeRemainingBytesAsString();
  (void)Gpt2BpeTokenizer::pretokenize(text);
  polytrain::fuzz::expect_value_or_input_error([&] {
    polytrain::fuzz::MemFile e(encoder), m(merges);
    check(Gpt2BpeTokenizer::from_files(e.path(), m.path()), text);
  });
  if (const auto* t = gpt2()) check(*t, text);
  return 0;
}
