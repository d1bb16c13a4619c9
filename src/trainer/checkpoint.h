// Checkpoints: <dir>/<tag>/{state.pt, meta.json} plus <dir>/latest naming the newest tag, as
// DeepSpeed lays them out. Written atomically (temp dir, fsync, rename; `latest` moved last) and
// verified on load (size + CRC32C recorded in meta.json). What goes in state.pt is the caller's.
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/torch_fwd.h"

namespace polytrain {

/// Writes <dir>/<tag>/ atomically: `fill` adds entries to the archive, `meta` is stored in
/// meta.json together with the checksum. When set_latest, <dir>/latest then names tag.
/// A crash at any point leaves the previous checkpoint and `latest` intact.
void write_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& meta,
                      const std::function<void(torch::serialize::OutputArchive&)>& fill,
                      bool set_latest = true,
                      const std::function<void(const std::string& tmp_dir)>& extra_files = {});

/// The tag named by <dir>/latest; InputError when the folder or the file is missing.
std::string latest_checkpoint_tag(const std::string& dir);

/// Verifies <dir>/<tag> (meta.json readable, state.pt size and CRC32C) and hands its archive
/// to `read`. Returns meta.json. InputError naming the file on any mismatch or corruption.
nlohmann::json read_checkpoint(const std::string& dir, const std::string& tag,
                               const std::function<void(torch::serialize::InputArchive&)>& read);

/// Removes <dir>/<tag> (used to keep only the last N step checkpoints).
void remove_checkpoint(const std::string& dir, const std::string& tag);

/// Model parameters and buffers into / out of an archive, by name. Loading checks that every
/// name is present with the same shape (InputError naming the first mismatch).
void save_module(torch::nn::Module& module, torch::serialize::OutputArchive& archive);
void load_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& origin);

}  // namespace polytrain
