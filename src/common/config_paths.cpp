// The input-path rule of config_paths.h: each input key of a config file resolved against the
// file's folder, then the current directory, and checked readable before the run starts.
// Output folders (trainer.save_dir, experiments_dir, load_dir, tensorboard/csv_monitor
// output_path, hivemind.identity_path) are left as given: the current directory's, as DeepSpeed's.
#include "polytrain/common/config_paths.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "polytrain/common/config_keys.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace fs = std::filesystem;
using nlohmann::json;
using detail::cat;

namespace {

// An input path in a document: its key as messages name it and the JSON value holding it.
struct InputPath {
  std::string key;  ///< data.train_files[1]
  json* value;
};

// The input-file keys: data.train_files (each) and data.vocab_file (GPT-2's merges file is read
// beside it; T5's SentencePiece model is it). Entries of the wrong type are the parser's to report.
std::vector<InputPath> input_paths(json& doc) {
  std::vector<InputPath> out;
  if (!doc.is_object() || !doc.contains("data") || !doc["data"].is_object()) return out;
  json& data = doc["data"];
  if (data.contains("train_files") && data["train_files"].is_array())
    for (size_t i = 0; i < data["train_files"].size(); ++i)
      if (data["train_files"][i].is_string())
        out.push_back({cat("data.train_files[", i, "]"), &data["train_files"][i]});
  if (data.contains("vocab_file") && data["vocab_file"].is_string())
    out.push_back({"data.vocab_file", &data["vocab_file"]});
  return out;
}

bool given_by(const json& overrides, const std::string& key) {
  const std::string section = "data";
  const std::string name = key.substr(5, key.find('[') == std::string::npos ? std::string::npos : key.find('[') - 5);
  return overrides.is_object() && overrides.contains(section) && overrides[section].is_object() &&
         overrides[section].contains(name);
}

// "" when `path` can be opened for reading, else why not.
std::string unreadable(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return "is a directory, not a file";
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::strerror(errno);
  return "";
}

std::string cwd() {
  std::error_code ec;
  const fs::path p = fs::current_path(ec);
  return ec ? std::string(".") : p.string();
}

// One path from the config file: found in its folder, or else in the current directory. The value
// is rewritten to the config folder's path when found there; "" or why it cannot be read.
std::string resolve_file_path(const InputPath& in, const fs::path& folder) {
  const std::string given = in.value->get<std::string>();
  if (given.empty()) return "";  // not set: the program says what it needs
  const fs::path p(given);
  if (p.is_absolute()) {
    const std::string why = unreadable(p);
    return why.empty() ? "" : cat("'", in.key, "': cannot read '", given, "': ", why);
  }
  std::error_code ec;
  const fs::path beside = (folder / p).lexically_normal();
  if (fs::exists(beside, ec)) {
    *in.value = beside.string();
    const std::string why = unreadable(beside);
    return why.empty() ? "" : cat("'", in.key, "': cannot read '", beside.string(), "' (found in the config file's folder): ", why);
  }
  if (fs::exists(p, ec)) {
    const std::string why = unreadable(p);
    return why.empty() ? "" : cat("'", in.key, "': cannot read '", given, "' (found in the current directory, ", cwd(), "): ", why);
  }
  return cat("'", in.key, "': '", given, "' is neither in the config file's folder (", folder.string(),
             ") nor in the current directory (", cwd(), "); give a path relative to the config file, or an absolute one");
}

std::string check_command_line_path(const InputPath& in) {
  const std::string given = in.value->get<std::string>();
  if (given.empty()) return "";
  const std::string why = unreadable(given);
  if (why.empty()) return "";
  const bool relative = fs::path(given).is_relative();
  return cat("'", in.key, "' (command line): cannot read '", given, "': ", why,
             relative ? cat(" (paths on the command line are relative to the current directory, ", cwd(), ")") : "");
}

}  // namespace

std::vector<std::string> prepare_config_sources(json& file_doc, const std::string& config_path,
                                                const json& overrides) {
  config_detail::map_flagai_names(file_doc, nullptr);
  std::vector<std::string> errors;
  if (!config_path.empty()) {
    std::error_code ec;
    fs::path folder = fs::absolute(config_path, ec).parent_path();
    for (const InputPath& in : input_paths(file_doc))
      if (!given_by(overrides, in.key))
        if (std::string e = resolve_file_path(in, folder.lexically_normal()); !e.empty()) errors.push_back(e);
  }
  json flags = overrides;
  for (const InputPath& in : input_paths(flags))
    if (std::string e = check_command_line_path(in); !e.empty()) errors.push_back(e);
  return errors;
}

}  // namespace polytrain
