// encode_archive / decode_archive (checkpoint/archive_codec.h).
//
// The tree is a list of entries [key, kind, value(, device)] per archive, in the order the keys
// were written: kind "archive" (value: the nested list), "tensor" (value: the tensor's name in
// the safetensors data; a 4th element names a CUDA device it was on), "undefined" (an
// undefined tensor), "int", "double" (value: a 0-d F64 tensor's name, exact for NaN and
// infinities), "bool", "string", "strings" (a list of strings).
#include "polytrain/checkpoint/archive_codec.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <cctype>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "polytrain/common/error.h"
#include "polytrain/checkpoint/safetensors.h"

namespace polytrain {
namespace {

using json = nlohmann::json;
constexpr int kMaxDepth = 16;

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::string bytes;
  archive.save_to([&](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

// TorchScript attribute names, which every archive key must be (an archive key holds no dot).
bool valid_key(const std::string& key) {
  if (key.empty() || key.size() > 256 || key == "training") return false;
  if (!(std::isalpha(static_cast<unsigned char>(key[0])) || key[0] == '_')) return false;
  for (const char c : key)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

json walk(torch::serialize::InputArchive& in, NamedTensors& tensors, const std::string& path, int depth) {
  PT_CHECK(depth <= kMaxDepth, "archive nested deeper than ", kMaxDepth, " at ", path);
  json out = json::array();
  auto add_tensor = [&](const at::Tensor& t) {
    std::string name = std::to_string(tensors.size());
    tensors.emplace_back(name, t.detach());
    return name;
  };
  for (const auto& key : in.keys()) {
    // libtorch 1.x archives are TorchScript modules, whose own `training` flag is listed too.
    if (key == "training") continue;
    PT_CHECK(valid_key(key), "archive key '", path, key, "' cannot be encoded");
    torch::serialize::InputArchive sub;
    if (in.try_read(key, sub)) {
      out.push_back({key, "archive", walk(sub, tensors, path + key + ".", depth + 1)});
      continue;
    }
    c10::IValue v;
    in.read(key, v);
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        out.push_back({key, "undefined", nullptr});
      } else if (t.device().is_cpu()) {
        out.push_back({key, "tensor", add_tensor(t)});
      } else {
        out.push_back({key, "tensor", add_tensor(t), t.device().str()});
      }
    } else if (v.isInt()) {
      out.push_back({key, "int", v.toInt()});
    } else if (v.isDouble()) {
      out.push_back({key, "double", add_tensor(at::scalar_tensor(v.toDouble(), at::kDouble))});
    } else if (v.isBool()) {
      out.push_back({key, "bool", v.toBool()});
    } else if (v.isString()) {
      out.push_back({key, "string", v.toStringRef()});
    } else if (v.isList()) {
      json strings = json::array();
      for (const auto& e : v.toListRef()) {
        PT_CHECK(e.isString(), "archive key '", path, key, "' is a list of ", e.tagKind(), ", which cannot be encoded");
        strings.push_back(e.toStringRef());
      }
      out.push_back({key, "strings", std::move(strings)});
    } else {
      PT_CHECK(false, "archive key '", path, key, "' holds a ", v.tagKind(), ", which cannot be encoded");
    }
  }
  return out;
}

struct Rebuild {
  const std::string& origin;
  std::map<std::string, at::Tensor> tensors;
  std::set<std::string> used;

  at::Tensor take(const json& name, const std::string& where) {
    PT_INPUT_CHECK(name.is_string(), origin, ": archive entry '", where, "' does not name a tensor");
    const auto it = tensors.find(name.get<std::string>());
    PT_INPUT_CHECK(it != tensors.end(), origin, ": archive entry '", where, "' names tensor '", name.get<std::string>(),
                   "', which is not in the data");
    PT_INPUT_CHECK(used.insert(it->first).second, origin, ": tensor '", it->first, "' is named by two archive entries");
    return it->second;
  }

  void build(const json& entries, torch::serialize::OutputArchive& archive, const std::string& path, int depth) {
    PT_INPUT_CHECK(depth <= kMaxDepth, origin, ": archive nested deeper than ", kMaxDepth);
    PT_INPUT_CHECK(entries.is_array(), origin, ": archive '", path, "' is not a list of entries");
    std::set<std::string> keys;
    for (const auto& e : entries) {
      PT_INPUT_CHECK(e.is_array() && (e.size() == 3 || e.size() == 4) && e[0].is_string() && e[1].is_string(), origin,
                     ": an entry of archive '", path, "' is not [key, kind, value]");
      const std::string key = e[0].get<std::string>(), kind = e[1].get<std::string>();
      const std::string where = path + key;
      PT_INPUT_CHECK(valid_key(key), origin, ": archive key '", where, "' is not an identifier");
      PT_INPUT_CHECK(keys.insert(key).second, origin, ": archive key '", where, "' appears twice");
      PT_INPUT_CHECK(e.size() == 3 || kind == "tensor", origin, ": archive entry '", where, "' has 4 fields");
      const json& value = e[2];
      if (kind == "archive") {
        torch::serialize::OutputArchive sub;
        build(value, sub, where + ".", depth + 1);
        archive.write(key, sub);
      } else if (kind == "tensor") {
        at::Tensor t = take(value, where);
        if (e.size() == 4) {
          static const std::regex kDevice("cuda(:[0-9]{1,3})?");
          PT_INPUT_CHECK(e[3].is_string() && std::regex_match(e[3].get<std::string>(), kDevice), origin,
                         ": archive entry '", where, "' names device ", e[3].dump(), ", not cuda[:N]");
          t = t.to(at::Device(e[3].get<std::string>()));
        }
        archive.write(key, c10::IValue(t));
      } else if (kind == "undefined") {
        PT_INPUT_CHECK(value.is_null(), origin, ": archive entry '", where, "' (undefined) holds a value");
        archive.write(key, c10::IValue(at::Tensor()));
      } else if (kind == "int") {
        PT_INPUT_CHECK(value.is_number_integer() &&
                           (value.is_number_unsigned() ? value.get<uint64_t>() <= uint64_t{INT64_MAX} : true),
                       origin, ": archive entry '", where, "' is not a 64-bit integer");
        archive.write(key, c10::IValue(value.get<int64_t>()));
      } else if (kind == "double") {
        const at::Tensor t = take(value, where);
        PT_INPUT_CHECK(t.dim() == 0 && t.scalar_type() == at::kDouble, origin, ": archive entry '", where,
                       "' (double) names a tensor that is not a 0-d F64");
        archive.write(key, c10::IValue(t.item<double>()));
      } else if (kind == "bool") {
        PT_INPUT_CHECK(value.is_boolean(), origin, ": archive entry '", where, "' is not a bool");
        archive.write(key, c10::IValue(value.get<bool>()));
      } else if (kind == "string") {
        PT_INPUT_CHECK(value.is_string(), origin, ": archive entry '", where, "' is not a string");
        archive.write(key, c10::IValue(value.get<std::string>()));
      } else if (kind == "strings") {
        PT_INPUT_CHECK(value.is_array(), origin, ": archive entry '", where, "' is not a list of strings");
        c10::List<std::string> list;
        for (const auto& s : value) {
          PT_INPUT_CHECK(s.is_string(), origin, ": archive entry '", where, "' is not a list of strings");
          list.push_back(s.get<std::string>());
        }
        archive.write(key, c10::IValue(list));
      } else {
        PT_INPUT_CHECK(false, origin, ": archive entry '", where, "' has unknown kind '", kind, "'");
      }
    }
  }
};

}  // namespace

std::string encode_archive(torch::serialize::OutputArchive& archive) {
  torch::serialize::InputArchive in;
  {
    // libtorch has no way to read an OutputArchive back but through its bytes: its own,
    // fresh from save_to, so the TorchScript reader sees nothing from outside.
    const std::string bytes = archive_bytes(archive);
    in.load_from(bytes.data(), bytes.size());
  }
  NamedTensors tensors;
  const json tree = {{"version", kArchiveTreeVersion}, {"root", walk(in, tensors, "", 0)}};
  std::string text;
  try {
    text = tree.dump();
  } catch (const json::exception& e) {  // a string that is not UTF-8
    throw InternalError(std::string("archive cannot be encoded: ") + e.what());
  }
  return safetensors_bytes(tensors, {{kArchiveTreeKey, text}}, "archive");
}

namespace {

// decode_archive up to the libtorch archive: every check, and `rebuilt` filled.
void rebuild(std::string_view bytes, const std::string& origin, torch::serialize::OutputArchive& rebuilt) {
  std::map<std::string, std::string> meta;
  NamedTensors tensors = parse_safetensors(bytes, origin, &meta);
  const auto it = meta.find(kArchiveTreeKey);
  PT_INPUT_CHECK(it != meta.end(), origin, ": not a polytrain archive (its safetensors metadata has no '",
                 kArchiveTreeKey, "')");
  const json tree = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  PT_INPUT_CHECK(!tree.is_discarded() && tree.is_object(), origin, ": '", kArchiveTreeKey,
                 "' metadata is not a JSON object");
  const auto version = tree.find("version");
  PT_INPUT_CHECK(version != tree.end() && *version == kArchiveTreeVersion, origin, ": archive tree version ",
                 version == tree.end() ? std::string("missing") : version->dump(), " (this build reads ",
                 kArchiveTreeVersion, ")");
  PT_INPUT_CHECK(tree.contains("root"), origin, ": archive tree has no 'root'");
  Rebuild r{origin, {}, {}};
  for (auto& [name, t] : tensors) r.tensors.emplace(name, std::move(t));
  tensors.clear();
  r.build(tree["root"], rebuilt, "", 0);
  PT_INPUT_CHECK(r.used.size() == r.tensors.size(), origin, ": holds ", r.tensors.size() - r.used.size(),
                 " tensor(s) no archive entry names");
}

}  // namespace

void decode_archive(std::string_view bytes, const std::string& origin, torch::serialize::InputArchive& out) {
  torch::serialize::OutputArchive rebuilt;
  rebuild(bytes, origin, rebuilt);
  const std::string own = archive_bytes(rebuilt);
  out.load_from(own.data(), own.size());
}

void check_archive(std::string_view bytes, const std::string& origin) {
  torch::serialize::OutputArchive rebuilt;
  rebuild(bytes, origin, rebuilt);
}

}  // namespace polytrain
