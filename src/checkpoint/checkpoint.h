// Checkpoints: <dir>/<tag>/ plus <dir>/latest naming the newest tag, as DeepSpeed lays them out.
// A checkpoint is written by every rank of a job: state.pt (the consolidated model and what
// the job shares, by the rank with writes_model), rank_<r>.pt (each rank's own state: its RNG,
// its backend shard) and rank_<r>.files.json (that rank's receipt: sizes and CRC32C of what
// it wrote). After a barrier the committing rank writes complete.json, the completion marker
// (grid shape, every file's size and checksum, the caller's metadata), renames the folder into
// place and moves `latest`. Only a checkpoint with its marker is loadable; a kill at any point
// leaves the previous one and `latest` intact (llm.c's per-rank state + DONE file protocol).
// A save that fails (a full disk included) removes its <tag>.tmp folder; running out of space
// is an InputError stating the bytes the checkpoint needs and the bytes free there.
// What goes into each file is the caller's.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include <ATen/core/Tensor.h>

#include "polytrain/common/torch_fwd.h"

namespace polytrain {

/// What the write protocol needs from the job.
struct CheckpointGroup {
  int64_t rank = 0;
  int64_t world_size = 1;
  bool commits = true;                ///< this rank writes the marker and `latest`
  std::function<void()> barrier = [] {};  ///< every rank of the job
};

/// Writes one checkpoint from every rank (see the file comment). Collective: every rank
/// constructs it, writes its files, then calls commit().
class CheckpointWriter {
 public:
  /// Barrier; the committing rank clears <dir>/<tag>.tmp from an earlier interrupted save and
  /// creates it; barrier.
  CheckpointWriter(std::string dir, std::string tag, CheckpointGroup group);
  /// Without commit() (an exception on its way): removes <tag>.tmp.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  /// Writes <tmp>/<name> atomically (fsynced) and records it in this rank's receipt.
  void write_file(const std::string& name, const std::string& bytes);
  void write_archive(const std::string& name, torch::serialize::OutputArchive& archive);
  /// Records a file the caller wrote into tmp_dir() itself (e.g. safetensors).
  void add_file(const std::string& name);
  /// `produce` writes tmp_dir()/name (its path is passed); then add_file(name). A NoSpaceError
  /// inside becomes the checkpoint's out-of-space error, as for write_file.
  void produce_file(const std::string& name, const std::function<void(const std::string& path)>& produce,
                    uint64_t expected_bytes);
  std::string tmp_dir() const { return tmp_; }
  /// Writes this rank's receipt; barrier; the committing rank writes complete.json with `meta`,
  /// renames the folder into place and (when set_latest) points `latest` at it; barrier.
  void commit(const nlohmann::json& meta, bool set_latest);

 private:
  void write_small(const std::string& name, const std::string& bytes);
  void write_guarded(const std::string& name, uint64_t bytes, const std::function<void(const std::string& path)>& write);
  [[noreturn]] void out_of_space(const std::string& name, uint64_t file_bytes, const std::string& why);

  std::string dir_, tag_, tmp_;
  CheckpointGroup group_;
  nlohmann::json files_ = nlohmann::json::object();
  uint64_t written_ = 0;   ///< bytes of this rank's files so far
  bool committed_ = false;
};

/// A verified checkpoint: complete.json read and checked; files are checked against it when
/// opened. InputError naming the file on a missing marker, a mismatch or corruption.
class CheckpointReader {
 public:
  CheckpointReader(const std::string& dir, const std::string& tag);
  /// complete.json as written (the caller's meta plus files, grid, format_version, tag).
  const nlohmann::json& meta() const { return meta_; }
  bool has_file(const std::string& name) const;
  /// The file's bytes after the size and CRC32C check.
  std::string read(const std::string& name) const;
  /// read() into an archive; `use` runs on it, and a libtorch error inside becomes an
  /// InputError naming the file.
  void read_archive(const std::string& name, const std::function<void(torch::serialize::InputArchive&)>& use) const;
  std::string path(const std::string& name) const;
  /// The checkpoint's folder (for messages).
  const std::string& dir() const { return cdir_; }

 private:
  std::string cdir_;
  nlohmann::json meta_;
};

/// A backend's view of a checkpoint's shards while loading: shard_<r>.pt is what rank r's
/// backend saved (absent when that rank saved none), and the layout they came from.
class ShardReader {
 public:
  explicit ShardReader(const CheckpointReader& checkpoint) : checkpoint_(checkpoint) {}
  static std::string file_name(int64_t rank) { return "shard_" + std::to_string(rank) + ".pt"; }
  /// {"world", "tp", "dp", "pp"} as saved.
  const nlohmann::json& saved_grid() const;
  int64_t saved_world_size() const { return saved_grid().at("world").get<int64_t>(); }
  /// The env_type whose backend saved the shards ("" when not recorded).
  std::string env_type() const {
    const auto& m = checkpoint_.meta();
    return m.contains("env_type") && m["env_type"].is_string() ? m["env_type"].get<std::string>() : std::string();
  }
  /// The checkpoint's folder, for messages.
  const std::string& origin() const { return checkpoint_.dir(); }
  bool has_shard(int64_t rank) const { return checkpoint_.has_file(file_name(rank)); }
  /// Verifies shard_<rank>.pt and hands its archive to `use` with the file's path (for messages).
  void read_shard(int64_t rank,
                  const std::function<void(torch::serialize::InputArchive&, const std::string& origin)>& use) const {
    checkpoint_.read_archive(file_name(rank), [&](torch::serialize::InputArchive& a) { use(a, checkpoint_.path(file_name(rank))); });
  }

 private:
  const CheckpointReader& checkpoint_;
};

/// The tag named by <dir>/latest; InputError when the folder or the file is missing.
std::string latest_checkpoint_tag(const std::string& dir);

/// Single-process convenience: a checkpoint whose only content is state.pt (`fill` adds its
/// entries) plus what `extra_files` writes into the temporary folder; `meta` is stored in
/// complete.json. When set_latest, <dir>/latest then names tag.
void write_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& meta,
                      const std::function<void(torch::serialize::OutputArchive&)>& fill, bool set_latest = true,
                      const std::function<void(const std::string& tmp_dir)>& extra_files = {});

/// Verifies <dir>/<tag> and hands state.pt's archive to `read`. Returns the metadata.
nlohmann::json read_checkpoint(const std::string& dir, const std::string& tag,
                               const std::function<void(torch::serialize::InputArchive&)>& read);

/// Removes <dir>/<tag> (used to keep only the last N step checkpoints).
void remove_checkpoint(const std::string& dir, const std::string& tag);

/// Named tensors into / out of an archive (archive keys cannot hold dots, so tensors go
/// under t<i> and the names in a string list).
void save_named_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        torch::serialize::OutputArchive& archive);
std::vector<std::pair<std::string, at::Tensor>> load_named_tensors_archive(torch::serialize::InputArchive& archive);

/// A module's parameters and buffers by name (the tensors themselves, not copies).
std::vector<std::pair<std::string, at::Tensor>> module_state(torch::nn::Module& module);
/// Copies `state` into the module's parameters and buffers; every name must be present with
/// the same shape and nothing else may be there (InputError naming `origin` and the tensor).
void load_module_state(torch::nn::Module& module, const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& origin);

}  // namespace polytrain
