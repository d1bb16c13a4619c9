// HF layout save/load: name matching (base-model prefix, tied and ignored names) and the checks
// that make a wrong checkpoint a one-line error before any weight is touched.
#include "polytrain/models/hf_pretrained.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <torch/torch.h>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace fs = std::filesystem;
using detail::cat;

namespace {

bool matches_any(const std::string& name, const std::vector<std::regex>& patterns) {
  for (const auto& p : patterns)
    if (std::regex_search(name, p)) return true;
  return false;
}

std::vector<std::regex> compile(const std::vector<std::string>& patterns) {
  std::vector<std::regex> out;
  for (const auto& p : patterns) out.emplace_back(p, std::regex::ECMAScript);
  return out;
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::string name_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 4; ++i) out += (i ? ", " : "") + ("'" + names[i] + "'");
  if (names.size() > 4) out += cat(" and ", names.size() - 4, " more");
  return out;
}

}  // namespace

void save_pretrained(const torch::nn::Module& model, const nlohmann::json& config, const std::string& dir,
                     const std::vector<std::string>& skip) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  PT_INPUT_CHECK(!ec && fs::is_directory(dir), dir, ": cannot create directory: ", ec.message());
  const auto skipped = compile(skip);
  NamedTensors tensors;
  for (const auto& item : model.named_parameters(true))
    if (!matches_any(item.key(), skipped)) tensors.emplace_back(item.key(), item.value().detach());
  for (const auto& item : model.named_buffers(true))
    if (!matches_any(item.key(), skipped)) tensors.emplace_back(item.key(), item.value().detach());
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  atomic_write_file((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

nlohmann::json read_pretrained_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream in(path, std::ios::binary);
  PT_INPUT_CHECK(in, path, ": cannot read (not an HF model directory?)");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_json_strict(text.str(), path);
}

void load_named_tensors(torch::nn::Module& model, const NamedTensors& tensors, const HfLoadOptions& options,
                        const std::string& origin) {
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : model.named_parameters(true)) targets.emplace(item.key(), item.value());
  for (const auto& item : model.named_buffers(true)) targets.emplace(item.key(), item.value());

  // A bare base-model checkpoint (HF BertModel / GPT2Model) names tensors without the prefix.
  const std::string prefix = options.base_prefix.empty() ? "" : options.base_prefix + ".";
  bool checkpoint_has_prefix = prefix.empty();
  for (const auto& [name, t] : tensors)
    if (!prefix.empty() && name.rfind(prefix, 0) == 0) checkpoint_has_prefix = true;
  auto model_name = [&](const std::string& name) {
    if (checkpoint_has_prefix || targets.count(name)) return name;
    return prefix + name;
  };

  const auto optional = compile(options.optional), ignored = compile(options.ignore_unused);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (model tensor, checkpoint tensor)
  std::vector<std::string> unused, mismatched;
  std::map<std::string, bool> found;
  for (const auto& [name, t] : tensors) {
    const std::string target = model_name(name);
    auto it = targets.find(target);
    if (it == targets.end()) {
      if (!matches_any(name, ignored) && !matches_any(target, ignored)) unused.push_back(name);
      continue;
    }
    if (it->second.sizes() != t.sizes()) {
      mismatched.push_back(cat("'", name, "' is ", shape_str(t.sizes()), ", the model's is ",
                               shape_str(it->second.sizes())));
      continue;
    }
    found[target] = true;
    copies.emplace_back(it->second, t);
  }
  std::vector<std::string> missing;
  for (const auto& [name, t] : targets)
    if (!found.count(name) && !matches_any(name, optional)) missing.push_back(name);
  PT_INPUT_CHECK(mismatched.empty(), origin, ": shape mismatch (does config.json match the weights?): ",
                 mismatched.front(), mismatched.size() > 1 ? cat(" and ", mismatched.size() - 1, " more") : "");
  PT_INPUT_CHECK(missing.empty(), origin, ": missing ", missing.size(), " tensor(s) the model needs: ",
                 name_list(missing));
  PT_INPUT_CHECK(unused.empty(), origin, ": ", unused.size(), " tensor(s) the model has no place for: ",
                 name_list(unused), " (a checkpoint of another architecture?)");
  torch::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(src);
}

void load_pretrained_weights(torch::nn::Module& model, const std::string& dir, const HfLoadOptions& options) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  PT_INPUT_CHECK(fs::exists(path), path, ": not found (HF sharded or .bin checkpoints are not read; ",
                 "convert them to one model.safetensors)");
  load_named_tensors(model, load_safetensors(path), options, path);
}

}  // namespace polytrain
