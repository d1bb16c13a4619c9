// A .deepspeed_env file (KEY=VALUE lines the launcher exports to every worker).
#include "fuzz_util.h"
#include "polytrain/launcher/env_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  polytrain::fuzz::expect_value_or_input_error([&] {
    const auto env = polytrain::launcher::parse_env_file(text, "fuzz/.deepspeed_env");
    for (const auto& [key, value] : env)
      if (key.empty() || key.find('=') != std::string::npos) __builtin_trap();  // not exportable
  });
  return 0;
}
