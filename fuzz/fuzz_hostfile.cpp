// Hostfile text, --include/--exclude specs, the slot lists and the run-length slot layout the
// launcher passes to its nodes, and host names.
#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_util.h"
#include "polytrain/launcher/hostfile.h"

using namespace polytrain::launcher;
using polytrain::fuzz::expect_value_or_input_error;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string spec = in.ConsumeRandomLengthString(256);
  const int node = in.ConsumeIntegral<int>();
  const std::string text = in.ConsumeRemainingBytesAsString();
  expect_value_or_input_error([&] {
    const ResourcePool pool = parse_hostfile(text, "fuzz.hostfile");
    // What the launcher does with a parsed pool must hold for any pool the parser accepts.
    const ResourcePool back = decode_pool(encode_pool(pool));
    if (encode_pool(back) != encode_pool(pool)) __builtin_trap();
    expect_value_or_input_error([&] { filter_resources(pool, spec, ""); });
    expect_value_or_input_error([&] { filter_resources(pool, "", spec); });
    const std::string layout = encode_slot_layout(pool);
    expect_value_or_input_error([&] { node_in_layout(layout, node); });
  });
  expect_value_or_input_error([&] { parse_filter_spec(text, "--include"); });
  expect_value_or_input_error([&] { decode_slots(spec, "--node_slots"); });
  expect_value_or_input_error([&] { node_in_layout(spec, node); });
  expect_value_or_input_error([&] { decode_pool(text); });
  (void)valid_host_name(spec);
  return 0;
}
