// complete.json's schema (checkpoint/checkpoint_marker.h).
#include "polytrain/checkpoint/checkpoint_marker.h"

#include <cstdint>

#include "polytrain/common/error.h"

namespace polytrain {
namespace {

bool is_int_at_least(const nlohmann::json& v, int64_t lo) {
  if (v.is_number_unsigned()) return lo <= 0 || v.get<uint64_t>() >= static_cast<uint64_t>(lo);
  return v.is_number_integer() && v.get<int64_t>() >= lo;
}

// A name the reader may join to the checkpoint's folder: no separator, not . or .., no NUL.
bool plain_file_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos && n.find('\0') == std::string::npos;
}

}  // namespace

void check_checkpoint_marker(const nlohmann::json& meta, const std::string& marker) {
  PT_INPUT_CHECK(meta.is_object(), marker, ": not a JSON object");
  const auto version = meta.find("format_version");
  PT_INPUT_CHECK(version != meta.end() && version->is_number_integer(), marker,
                 ": 'format_version' is missing or not an integer");
  PT_INPUT_CHECK(*version == kCheckpointFormatVersion, marker, ": unsupported checkpoint format_version ",
                 version->dump(), " (this build reads ", kCheckpointFormatVersion,
                 *version == 2 ? "; format 2 held TorchScript archives, which this build does not load" : "", ")");
  const auto files = meta.find("files");
  PT_INPUT_CHECK(files != meta.end() && files->is_object(), marker, ": no 'files' record");
  for (const auto& [name, rec] : files->items()) {
    PT_INPUT_CHECK(plain_file_name(name), marker, ": 'files' names '", name, "', not a plain file name");
    PT_INPUT_CHECK(rec.is_object(), marker, ": 'files.", name, "' is not an object");
    const auto size = rec.find("size");
    PT_INPUT_CHECK(size != rec.end() && is_int_at_least(*size, 0), marker, ": 'files.", name,
                   ".size' is missing or not an integer >= 0");
    const auto crc = rec.find("crc32c");
    PT_INPUT_CHECK(crc != rec.end() && is_int_at_least(*crc, 0) && crc->get<uint64_t>() <= UINT32_MAX, marker,
                   ": 'files.", name, ".crc32c' is missing or not a 32-bit unsigned integer");
    const auto rank = rec.find("rank");
    PT_INPUT_CHECK(rank == rec.end() || is_int_at_least(*rank, 0), marker, ": 'files.", name,
                   ".rank' is not an integer >= 0");
  }
  const auto tag = meta.find("tag");
  PT_INPUT_CHECK(tag == meta.end() || tag->is_string(), marker, ": 'tag' is not a string");
  for (const char* key : {"step", "world_size", "skipped_steps", "applied_steps"}) {
    const auto v = meta.find(key);
    PT_INPUT_CHECK(v == meta.end() || is_int_at_least(*v, 0), marker, ": '", key, "' is not an integer >= 0, got ",
                   v == meta.end() ? "" : v->dump());
  }
  if (const auto grid = meta.find("grid"); grid != meta.end()) {
    PT_INPUT_CHECK(grid->is_object(), marker, ": 'grid' is not an object");
    for (const char* key : {"world", "tp", "dp", "pp"}) {
      const auto v = grid->find(key);
      PT_INPUT_CHECK(v == grid->end() || is_int_at_least(*v, 1), marker, ": 'grid.", key,
                     "' is not an integer >= 1");
    }
    PT_INPUT_CHECK(grid->contains("world"), marker, ": 'grid' has no 'world'");
  }
  const auto env = meta.find("env_type");
  PT_INPUT_CHECK(env == meta.end() || env->is_string(), marker, ": 'env_type' is not a string");
  const auto scaler = meta.find("loss_scaler");
  PT_INPUT_CHECK(scaler == meta.end() || scaler->is_null() || scaler->is_object(), marker,
                 ": 'loss_scaler' is not an object");
  const auto best = meta.find("best_eval_loss");
  PT_INPUT_CHECK(best == meta.end() || best->is_null() || best->is_number(), marker,
                 ": 'best_eval_loss' is not a number");
}

}  // namespace polytrain
