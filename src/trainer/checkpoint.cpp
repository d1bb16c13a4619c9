// Checkpoint files: the atomic write protocol and the verified read. The protocol, in order:
//   1. write state.pt, meta.json (+ extras) into <dir>/<tag>.tmp.<pid>/, fsync each file and the dir;
//   2. if <dir>/<tag> exists, rename it aside to <dir>/<tag>.old.<pid>; rename tmp -> <dir>/<tag>;
//   3. fsync <dir>; atomically replace <dir>/latest; remove the aside copy.
// A kill before 3 leaves `latest` naming the previous, complete checkpoint.
#include "trainer/checkpoint.h"

#include <unistd.h>

#include <filesystem>
#include <sstream>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include "common/atomic_file.h"
#include "common/config.h"
#include "common/crc32c.h"
#include "common/error.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;

}  // namespace

void write_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& meta,
                      const std::function<void(torch::serialize::OutputArchive&)>& fill,
                      bool set_latest,
                      const std::function<void(const std::string&)>& extra_files) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError("cannot create checkpoint folder " + dir + ": " + ec.message());
  const std::string pid = std::to_string(::getpid());
  const fs::path final_dir = fs::path(dir) / tag;
  const fs::path tmp_dir = fs::path(dir) / (tag + ".tmp." + pid);
  const fs::path old_dir = fs::path(dir) / (tag + ".old." + pid);
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir);
  try {
    torch::serialize::OutputArchive archive;
    fill(archive);
    std::ostringstream os;
    archive.save_to(os);
    const std::string bytes = os.str();
    atomic_write_file((tmp_dir / "state.pt").string(), bytes);
    if (extra_files) extra_files(tmp_dir.string());
    nlohmann::json m = meta;
    m["format_version"] = kFormatVersion;
    m["tag"] = tag;
    m["files"]["state.pt"] = {{"size", bytes.size()}, {"crc32c", crc32c(bytes.data(), bytes.size())}};
    atomic_write_file((tmp_dir / "meta.json").string(), m.dump(2) + "\n");
    fsync_dir(tmp_dir.string());
    if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
    fs::rename(tmp_dir, final_dir);
    fsync_dir(dir);
    if (set_latest) atomic_write_file((fs::path(dir) / "latest").string(), tag + "\n");
    fs::remove_all(old_dir, ec);
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    if (!fs::exists(final_dir) && fs::exists(old_dir)) fs::rename(old_dir, final_dir, ec);
    throw;
  }
}

std::string latest_checkpoint_tag(const std::string& dir) {
  PT_INPUT_CHECK(fs::is_directory(dir), "checkpoint folder ", dir, " does not exist");
  const std::string path = (fs::path(dir) / "latest").string();
  PT_INPUT_CHECK(fs::exists(path), "checkpoint folder ", dir, " has no 'latest' file (nothing saved there)");
  std::string tag = read_file(path);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
  PT_INPUT_CHECK(!tag.empty() && tag.find('/') == std::string::npos, path, ": malformed tag '", tag, "'");
  return tag;
}

nlohmann::json read_checkpoint(const std::string& dir, const std::string& tag,
                               const std::function<void(torch::serialize::InputArchive&)>& read) {
  const fs::path cdir = fs::path(dir) / tag;
  const std::string meta_path = (cdir / "meta.json").string();
  PT_INPUT_CHECK(fs::is_directory(cdir), "checkpoint ", cdir.string(), " does not exist");
  nlohmann::json meta = parse_json_strict(read_file(meta_path), meta_path);
  PT_INPUT_CHECK(meta.value("format_version", 0) == kFormatVersion, meta_path,
                 ": unsupported checkpoint format_version ", meta.value("format_version", 0));
  const std::string state_path = (cdir / "state.pt").string();
  const std::string bytes = read_file(state_path);
  const auto& rec = meta.at("files").at("state.pt");
  PT_INPUT_CHECK(bytes.size() == rec.at("size").get<size_t>(), state_path, ": truncated or corrupt (",
                 bytes.size(), " bytes, meta.json records ", rec.at("size").get<size_t>(), ")");
  PT_INPUT_CHECK(crc32c(bytes.data(), bytes.size()) == rec.at("crc32c").get<uint32_t>(), state_path,
                 ": checksum mismatch (file corrupt)");
  torch::serialize::InputArchive archive;
  try {
    std::istringstream is(bytes);
    archive.load_from(is);
    read(archive);
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw InputError(state_path + ": cannot load: " + what.substr(0, what.find('\n')));
  }
  return meta;
}

void remove_checkpoint(const std::string& dir, const std::string& tag) {
  std::error_code ec;
  fs::remove_all(fs::path(dir) / tag, ec);
}

void save_module(torch::nn::Module& module, torch::serialize::OutputArchive& archive) {
  // Archive keys cannot hold dots, so tensors go under t<i> and the names in a string list.
  std::vector<std::string> names;
  int64_t i = 0;
  for (const auto& p : module.named_parameters(true)) {
    names.push_back(p.key());
    archive.write("t" + std::to_string(i++), p.value().detach().cpu());
  }
  for (const auto& b : module.named_buffers(true)) {
    names.push_back(b.key());
    archive.write("t" + std::to_string(i++), b.value().detach().cpu(), /*is_buffer=*/true);
  }
  archive.write("names", c10::IValue(c10::List<std::string>(names)));
}

void load_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& origin) {
  c10::IValue names_iv;
  archive.read("names", names_iv);
  std::map<std::string, int64_t> index;
  int64_t i = 0;
  for (const auto& n : names_iv.toListRef()) index[n.toStringRef()] = i++;
  torch::NoGradGuard no_grad;
  auto load_one = [&](const std::string& name, at::Tensor& dst, bool is_buffer) {
    auto it = index.find(name);
    PT_INPUT_CHECK(it != index.end(), origin, ": has no tensor '", name, "' (a different model?)");
    at::Tensor src;
    archive.read("t" + std::to_string(it->second), src, is_buffer);
    PT_INPUT_CHECK(src.sizes() == dst.sizes(), origin, ": tensor '", name, "' has shape ", src.sizes(),
                   ", the model expects ", dst.sizes());
    dst.copy_(src);
  };
  for (auto& p : module.named_parameters(true)) load_one(p.key(), p.value(), false);
  for (auto& b : module.named_buffers(true)) load_one(b.key(), b.value(), true);
  const size_t expected = module.named_parameters(true).size() + module.named_buffers(true).size();
  PT_INPUT_CHECK(index.size() == expected, origin, ": holds ", index.size(), " tensors, the model has ",
                 expected, " (a different model?)");
}

}  // namespace polytrain
