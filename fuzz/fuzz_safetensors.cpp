// A model.safetensors file: the 8-byte header size, the JSON header (dtypes, shapes,
// data_offsets, __metadata__) and the data area, read by load_safetensors. -malloc_limit_mb
// makes any allocation sized from the file's fields beyond the file's own size a crash; a
// file it accepts must be written back (save_safetensors) to a file that loads the same.
#include <ATen/ATen.h>

#include <unistd.h>

#include "fuzz_util.h"
#include "polytrain/checkpoint/safetensors.h"

using namespace polytrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  fuzz::MemFile f(bytes);
  fuzz::expect_value_or_input_error([&] {
    std::map<std::string, std::string> meta;
    const NamedTensors tensors = load_safetensors(f.path(), &meta);
    size_t total = 0;
    for (const auto& [name, t] : tensors) total += t.nbytes();
    if (total > size) __builtin_trap();  // more tensor bytes than the file holds
    static const std::string out = std::string(access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") + "/fuzz_safetensors." + std::to_string(::getpid());
    save_safetensors(out, tensors, meta);
    std::map<std::string, std::string> meta2;
    const NamedTensors again = load_safetensors(out, &meta2);
    if (again.size() != tensors.size() || meta2 != meta) __builtin_trap();
    for (size_t i = 0; i < again.size(); ++i)
      if (again[i].first != tensors[i].first || !again[i].second.equal(tensors[i].second)) __builtin_trap();
  });
  return 0;
}
