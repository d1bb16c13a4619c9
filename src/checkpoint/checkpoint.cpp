// Checkpoint files: the sharded write protocol and the verified read. In order:
//   1. barrier; the committer clears <dir>/<tag>.tmp and creates it; barrier (nobody writes
//      into a folder that is about to be cleared);
//   2. every rank writes its files into it (atomic, fsynced) and then its receipt
//      rank_<r>.files.json; barrier;
//   3. the committer reads every receipt, writes complete.json (the marker), fsyncs the
//      folder, moves an existing <dir>/<tag> aside, renames tmp -> <dir>/<tag>, fsyncs <dir>,
//      atomically replaces <dir>/latest and removes the aside copy; barrier.
// A kill before the rename leaves `latest` naming the previous, complete checkpoint; a folder
// without complete.json is never loaded.
#include "polytrain/checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/config.h"
#include "polytrain/common/crc32c.h"
#include "polytrain/common/disk_space.h"
#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint_marker.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {

const char* const kMarker = "complete.json";

std::string receipt_name(int64_t rank) { return "rank_" + std::to_string(rank) + ".files.json"; }

// Bytes of the files of the checkpoint `latest` names in `dir` (its marker lists them); 0 when
// there is none or it cannot be read. The best estimate of what the next one needs.
uint64_t latest_checkpoint_bytes(const std::string& dir, std::string* tag) {
  if (!fs::exists(fs::path(dir) / "latest")) return 0;
  try {
    *tag = latest_checkpoint_tag(dir);
    const CheckpointReader ck(dir, *tag);
    uint64_t total = 0;
    for (const auto& [name, rec] : ck.meta()["files"].items()) total += rec["size"].get<uint64_t>();
    return total;
  } catch (const InputError&) {
    return 0;
  }
}

}  // namespace

CheckpointWriter::CheckpointWriter(std::string dir, std::string tag, CheckpointGroup group)
    : dir_(std::move(dir)), tag_(std::move(tag)), group_(std::move(group)) {
  tmp_ = (fs::path(dir_) / (tag_ + ".tmp")).string();
  group_.barrier();
  if (group_.commits) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw InputError("cannot create checkpoint folder " + dir_ + ": " + ec.message());
    fs::remove_all(tmp_, ec);
    fs::create_directories(tmp_, ec);
    if (ec) throw InputError("cannot create " + tmp_ + ": " + ec.message());
  }
  group_.barrier();
}

CheckpointWriter::~CheckpointWriter() {
  // Only the committing rank removes the unfinished folder: another rank's failure may be one a
  // fault-tolerant job survives (the save is redone), and the next save clears a leftover one.
  if (committed_ || !group_.commits) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

void CheckpointWriter::write_file(const std::string& name, const std::string& bytes) {
  write_small(name, bytes);
  files_[name] = {{"size", bytes.size()}, {"crc32c", crc32c(bytes.data(), bytes.size())}};
  written_ += bytes.size();
  fault_point("checkpoint");
}

void CheckpointWriter::produce_file(const std::string& name, const std::function<void(const std::string&)>& produce,
                                    uint64_t expected_bytes) {
  write_guarded(name, expected_bytes, produce);
  add_file(name);
}

static std::string bytes_text(uint64_t n) {
  char mb[32];
  std::snprintf(mb, sizeof mb, "%.1f MB", static_cast<double>(n) / 1e6);
  return std::to_string(n) + " bytes (" + mb + ")";
}

// One line: what failed, what the checkpoint needs (at least this rank's files so far plus the
// one that failed; the last complete checkpoint's size when that is more), what is free, and
// that nothing of this save is left behind.
void CheckpointWriter::out_of_space(const std::string& name, uint64_t file_bytes, const std::string& why) {
  std::error_code ec;
  fs::remove_all(tmp_, ec);
  std::string previous_tag;
  const uint64_t previous = latest_checkpoint_bytes(dir_, &previous_tag);
  const uint64_t attempted = written_ + file_bytes;
  std::string basis = "this rank's files up to " + name + " take " + std::to_string(attempted);
  if (previous > 0) basis += ", the last complete checkpoint " + previous_tag + " holds " + std::to_string(previous);
  std::string cause = why.substr(why.rfind(": ") + 2);
  if (cause == std::strerror(EFBIG)) cause += ": past this process's file-size limit, ulimit -f";
  const int64_t free_bytes = free_disk_bytes(dir_);
  throw InputError(detail::cat(
      "checkpoint ", (fs::path(dir_) / tag_).string(), ": out of space writing ", name, " (", cause,
      "): the checkpoint needs about ", bytes_text(std::max(previous, attempted)), " (", basis, "), the file system of ",
      dir_, " has ", free_bytes < 0 ? std::string("an unknown number of bytes") : bytes_text(free_bytes), " free; removed ",
      tmp_, previous > 0 ? ", the previous checkpoint and 'latest' are unchanged" : ", no earlier checkpoint is there",
      "; free space, or save elsewhere with --save_dir"));
}

void CheckpointWriter::write_archive(const std::string& name, torch::serialize::OutputArchive& archive) {
  write_file(name, encode_archive(archive));
}

void CheckpointWriter::add_file(const std::string& name) {
  const std::string bytes = read_file((fs::path(tmp_) / name).string());
  files_[name] = {{"size", bytes.size()}, {"crc32c", crc32c(bytes.data(), bytes.size())}};
  written_ += bytes.size();
}

void CheckpointWriter::commit(const nlohmann::json& meta, bool set_latest) {
  write_small(receipt_name(group_.rank), files_.dump() + "\n");
  group_.barrier();
  if (group_.commits) {
    nlohmann::json m = meta;
    m["format_version"] = kCheckpointFormatVersion;
    m["tag"] = tag_;
    m["files"] = nlohmann::json::object();
    for (int64_t r = 0; r < group_.world_size; ++r) {
      const std::string receipt = (fs::path(tmp_) / receipt_name(r)).string();
      PT_CHECK(fs::exists(receipt), "checkpoint ", tmp_, ": rank ", r, " wrote no receipt");
      const nlohmann::json files = parse_json_strict(read_file(receipt), receipt);
      for (const auto& [name, rec] : files.items()) {
        PT_CHECK(!m["files"].contains(name), "checkpoint ", tmp_, ": file ", name, " written by two ranks");
        m["files"][name] = rec;
        m["files"][name]["rank"] = r;
      }
    }
    write_small(kMarker, m.dump(2) + "\n");
    fsync_dir(tmp_);
    const fs::path final_dir = fs::path(dir_) / tag_;
    const fs::path old_dir = fs::path(dir_) / (tag_ + ".old." + std::to_string(::getpid()));
    std::error_code ec;
    try {
      if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
      fs::rename(tmp_, final_dir);
      fsync_dir(dir_);
      if (set_latest) atomic_write_file((fs::path(dir_) / "latest").string(), tag_ + "\n");
      fs::remove_all(old_dir, ec);
    } catch (...) {
      if (!fs::exists(final_dir) && fs::exists(old_dir)) fs::rename(old_dir, final_dir, ec);
      throw;
    }
  }
  group_.barrier();
  committed_ = true;
}

// tmp_dir()/name from `bytes`, atomically; unlisted (a receipt, the marker) unless the caller
// records it.
void CheckpointWriter::write_small(const std::string& name, const std::string& bytes) {
  write_guarded(name, bytes.size(), [&](const std::string& path) { atomic_write_file(path, bytes); });
}

// Every write of a save goes through here: a NoSpaceError becomes the save's out-of-space error.
void CheckpointWriter::write_guarded(const std::string& name, uint64_t bytes,
                                     const std::function<void(const std::string& path)>& write) {
  try {
    write((fs::path(tmp_) / name).string());
  } catch (const NoSpaceError& e) {
    out_of_space(name, bytes, e.what());
  }
}

CheckpointReader::CheckpointReader(const std::string& dir, const std::string& tag)
    : cdir_((fs::path(dir) / tag).string()) {
  PT_INPUT_CHECK(fs::is_directory(cdir_), "checkpoint ", cdir_, " does not exist");
  const std::string marker = path(kMarker);
  if (!fs::exists(marker)) {
    PT_INPUT_CHECK(!fs::exists(path("meta.json")), cdir_,
                   ": written by an older polytrain (checkpoint format 1, no complete.json); it cannot be loaded");
    throw InputError(cdir_ + ": no completion marker (complete.json): the save did not finish; use an earlier checkpoint");
  }
  meta_ = parse_json_strict(read_file(marker), marker);
  check_checkpoint_marker(meta_, marker);
}

std::string CheckpointReader::path(const std::string& name) const { return (fs::path(cdir_) / name).string(); }

bool CheckpointReader::has_file(const std::string& name) const { return meta_["files"].contains(name); }

std::string CheckpointReader::read(const std::string& name) const {
  const std::string p = path(name);
  PT_INPUT_CHECK(has_file(name), cdir_, ": has no ", name, " (the checkpoint's complete.json does not list it)");
  PT_INPUT_CHECK(fs::exists(p), p, ": missing (listed in complete.json)");
  const std::string bytes = read_file(p);
  const auto& rec = meta_["files"][name];  // its schema checked by check_checkpoint_marker
  PT_INPUT_CHECK(bytes.size() == rec["size"].get<uint64_t>(), p, ": truncated or corrupt (", bytes.size(),
                 " bytes, complete.json records ", rec["size"].get<uint64_t>(), ")");
  PT_INPUT_CHECK(crc32c(bytes.data(), bytes.size()) == rec["crc32c"].get<uint64_t>(), p,
                 ": checksum mismatch (file corrupt)");
  return bytes;
}

void CheckpointReader::read_archive(const std::string& name,
                                    const std::function<void(torch::serialize::InputArchive&)>& use) const {
  const std::string bytes = read(name);
  torch::serialize::InputArchive archive;
  try {
    decode_archive(bytes, path(name), archive);
    use(archive);
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw InputError(path(name) + ": cannot load: " + what.substr(0, what.find('\n')));
  }
}

const nlohmann::json& ShardReader::saved_grid() const {
  const auto& m = checkpoint_.meta();
  PT_INPUT_CHECK(m.contains("grid"), checkpoint_.path("complete.json"), ": no 'grid' record (not saved by a training job)");
  return m["grid"];  // its schema checked by check_checkpoint_marker
}

std::string latest_checkpoint_tag(const std::string& dir) {
  PT_INPUT_CHECK(fs::is_directory(dir), "checkpoint folder ", dir, " does not exist");
  const std::string path = (fs::path(dir) / "latest").string();
  PT_INPUT_CHECK(fs::exists(path), "checkpoint folder ", dir, " has no 'latest' file (nothing saved there)");
  std::string tag = read_file(path);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
  const bool control = std::any_of(tag.begin(), tag.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  PT_INPUT_CHECK(!tag.empty() && tag != "." && tag != ".." && tag.find('/') == std::string::npos && !control, path,
                 ": malformed tag (not a folder name of ", dir, ")");
  return tag;
}

void write_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& meta,
                      const std::function<void(torch::serialize::OutputArchive&)>& fill, bool set_latest,
                      const std::function<void(const std::string&)>& extra_files) {
  CheckpointWriter w(dir, tag, CheckpointGroup{});
  torch::serialize::OutputArchive archive;
  fill(archive);
  w.write_archive("state.pt", archive);
  if (extra_files) {
    extra_files(w.tmp_dir());
    for (const auto& e : fs::directory_iterator(w.tmp_dir())) {
      const std::string name = e.path().filename().string();
      if (name != "state.pt") w.add_file(name);
    }
  }
  w.commit(meta, set_latest);
}

nlohmann::json read_checkpoint(const std::string& dir, const std::string& tag,
                               const std::function<void(torch::serialize::InputArchive&)>& read) {
  CheckpointReader r(dir, tag);
  r.read_archive("state.pt", read);
  return r.meta();
}

void remove_checkpoint(const std::string& dir, const std::string& tag) {
  std::error_code ec;
  fs::remove_all(fs::path(dir) / tag, ec);
}

void save_named_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        torch::serialize::OutputArchive& archive) {
  std::vector<std::string> names;
  int64_t i = 0;
  for (const auto& [name, t] : tensors) {
    names.push_back(name);
    archive.write("t" + std::to_string(i++), t.detach().cpu());
  }
  archive.write("names", c10::IValue(c10::List<std::string>(names)));
}

std::vector<std::pair<std::string, at::Tensor>> load_named_tensors_archive(torch::serialize::InputArchive& archive) {
  c10::IValue names_iv;
  archive.read("names", names_iv);
  std::vector<std::pair<std::string, at::Tensor>> out;
  int64_t i = 0;
  for (const auto& n : names_iv.toListRef()) {
    at::Tensor t;
    archive.read("t" + std::to_string(i++), t);
    out.emplace_back(n.toStringRef(), t);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> module_state(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : module.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

void load_module_state(torch::nn::Module& module, const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& origin) {
  std::map<std::string, const at::Tensor*> index;
  for (const auto& [name, t] : state) index[name] = &t;
  torch::NoGradGuard no_grad;
  auto dst = module_state(module);
  for (auto& [name, t] : dst) {
    auto it = index.find(name);
    PT_INPUT_CHECK(it != index.end(), origin, ": has no tensor '", name, "' (a different model?)");
    PT_INPUT_CHECK(it->second->sizes() == t.sizes(), origin, ": tensor '", name, "' has shape ", it->second->sizes(),
                   ", the model expects ", t.sizes());
    t.copy_(*it->second);
  }
  PT_INPUT_CHECK(index.size() == dst.size(), origin, ": holds ", index.size(), " tensors, the model has ", dst.size(),
                 " (a different model?)");
}

}  // namespace polytrain
