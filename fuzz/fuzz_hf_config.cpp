// A Hugging Face config.json for every model family (BERT/RoBERTa, ALBERT, GPT-2, T5), read as
// from_pretrained reads it. A config a reader accepts must survive its writer and reader again
// (save_pretrained writes it back).
#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_util.h"
#include "polytrain/common/config.h"
#include "polytrain/models/albert_config.h"
#include "polytrain/models/bert_config.h"
#include "polytrain/models/gpt2_config.h"
#include "polytrain/models/t5_config.h"

using namespace polytrain;

namespace {
template <class From, class To>
void round_trip(const nlohmann::json& j, From from, To to) {
  fuzz::expect_value_or_input_error([&] {
    const auto cfg = from(j, "fuzz/config.json");
    const nlohmann::json written = to(cfg);
    if (to(from(written, "fuzz/config.json(written)")) != written) __builtin_trap();
  });
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = parse_json_strict(text, "fuzz/config.json");
  } catch (const InputError&) {
    return 0;
  }
  round_trip(j, bert_config_from_json, bert_config_to_json);
  round_trip(j, albert_config_from_json, albert_config_to_json);
  round_trip(j, gpt2_config_from_json, gpt2_config_to_json);
  round_trip(j, t5_config_from_json, t5_config_to_json);
  return 0;
}
