// The schema of a checkpoint's completion marker (complete.json), checked before any field is
// used: a marker edited by hand, truncated by a full disk or written by something else is an
// InputError naming the file and the key, never a JSON library exception mid-resume. No torch:
// fuzzed on its own (fuzz/fuzz_checkpoint.cpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace polytrain {

/// The marker's format_version this build writes and reads. 3: every .pt file is a
/// safetensors-encoded archive (checkpoint/archive_codec.h); 2 had TorchScript archives.
inline constexpr int kCheckpointFormatVersion = 3;

/// Checks `meta` (complete.json's parsed content; `marker` names the file in messages):
/// an object with format_version == kCheckpointFormatVersion; `files` an object of
/// {size: integer >= 0, crc32c: integer in [0, 2^32), rank: integer >= 0 (optional)} with names
/// that are plain file names; and, where present, tag (a string), step / world_size /
/// skipped_steps / applied_steps (integers >= 0), grid ({world, tp, dp, pp}: integers >= 1),
/// env_type (a string), loss_scaler (an object or null), best_eval_loss (a number or null).
void check_checkpoint_marker(const nlohmann::json& meta, const std::string& marker);

}  // namespace polytrain
