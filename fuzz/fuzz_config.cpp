// A DeepSpeed/polytrain JSON config through the same path a training program takes:
// parse_json_strict (duplicate keys, comments, numbers out of range) then config_from_json at a
// fuzzed world size. A config it accepts must survive config_to_json -> config_from_json.
#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_util.h"
#include "polytrain/common/config.h"

using namespace polytrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int64_t world = in.ConsumeIntegralInRange<int64_t>(1, 64);
  const std::string text = in.ConsumeRemainingBytesAsString();
  fuzz::expect_value_or_input_error([&] {
    const nlohmann::json doc = parse_json_strict(text, "fuzz.json");
    const Config cfg = config_from_json(doc, "fuzz.json", world);
    // What the program writes back (checkpoints record it) must read back the same.
    const nlohmann::json again = config_to_json(cfg);
    if (config_to_json(config_from_json(again, "fuzz.json(written)", world)) != again) __builtin_trap();
  });
  return 0;
}
