// A checkpoint folder as a resume finds it: <dir>/latest, <dir>/<tag>/complete.json and
// state.pt. The fuzzer writes all three. state.pt is either the fuzzer's bytes or a real
// archive (named tensors, as the trainer writes, encoded by archive_codec) with fuzzed bytes
// overwritten; its complete.json record can be made to match, so the archive decoder is
// reached too (before checkpoint format 3 that was libtorch's TorchScript reader, which
// crashed: fuzz/known_crashes, CheckpointMarker.HandEditedArchiveIsAnInputErrorNotACrash).
#include <fuzzer/FuzzedDataProvider.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include <filesystem>

#include "fuzz_util.h"
#include "polytrain/common/atomic_file.h"
#include "polytrain/common/crc32c.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/checkpoint/checkpoint_marker.h"

using namespace polytrain;
namespace fs = std::filesystem;

namespace {
const std::string& real_archive() {
  static const std::string bytes = [] {
    torch::serialize::OutputArchive a, model;
    save_named_tensors({{"w", torch::arange(6, torch::kFloat).view({2, 3})}, {"b", torch::ones({3}, torch::kLong)}}, model);
    a.write("model", model);
    return encode_archive(a);
  }();
  return bytes;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = std::string(fs::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") + "/fuzz_checkpoint." + std::to_string(::getpid());
  FuzzedDataProvider in(data, size);
  const bool use_real = in.ConsumeBool(), fix_record = in.ConsumeBool();
  const std::string latest = in.ConsumeRandomLengthString(64);
  std::string state = use_real ? real_archive() : in.ConsumeRandomLengthString(4096);
  if (use_real)
    for (int edits = in.ConsumeIntegralInRange(0, 8); edits > 0 && !state.empty(); --edits)
      state[in.ConsumeIntegralInRange<size_t>(0, state.size() - 1)] = static_cast<char>(in.ConsumeIntegral<uint8_t>());
  std::string marker = in.ConsumeRemainingBytesAsString();
  if (fix_record) {  // a well-formed marker around the fuzzed part, recording state.pt as written
    nlohmann::json m = {{"format_version", kCheckpointFormatVersion},
                        {"files", {{"state.pt", {{"size", state.size()}, {"crc32c", crc32c(state.data(), state.size())}}}}},
                        {"step", 1}};
    try {
      m["extra"] = nlohmann::json::parse(marker);
    } catch (const nlohmann::json::exception&) {
    }
    marker = m.dump();
  }
  fs::remove_all(dir);
  fs::create_directories(dir + "/t");
  atomic_write_file(dir + "/latest", latest);
  atomic_write_file(dir + "/t/complete.json", marker);
  atomic_write_file(dir + "/t/state.pt", state);
  fuzz::expect_value_or_input_error([&] { (void)latest_checkpoint_tag(dir); });
  fuzz::expect_value_or_input_error([&] {
    const CheckpointReader ck(dir, "t");
    ck.read_archive("state.pt", [](torch::serialize::InputArchive& a) {
      torch::serialize::InputArchive model;
      a.read("model", model);
      (void)load_named_tensors_archive(model);
    });
    const ShardReader shards(ck);
    if (ck.meta().contains("grid")) (void)shards.saved_world_size();
  });
  return 0;
}
