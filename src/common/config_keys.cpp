// JSON-level tools behind config.cpp: parse_json_strict (duplicate keys, FILE:LINE:COL errors),
// the strict typed ObjectReader, the nearest-key suggestion and the duplicate-key line finder.
// What the sections mean, their defaults and cross-field rules live in config.cpp.
#include "polytrain/common/config_keys.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>

#include "polytrain/common/nearest_name.h"

namespace polytrain::config_detail {

std::string nearest(const std::string& key, const std::vector<std::string>& known) {
  return nearest_name(key, known, 3);
}

std::string suggest(const std::string& key, const std::vector<std::string>& known) {
  const std::string best = nearest(key, known);
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::boolean: return v.get<bool>() ? "boolean true" : "boolean false";
    case json::value_t::string: {
      std::string s = v.dump();
      if (s.size() > 42) s = s.substr(0, 39) + "...\"";
      return "string " + s;
    }
    default: return "number " + v.dump();
  }
}

int duplicate_key_line(const std::string& t) {
  struct Frame {
    bool object;
    bool expect_key;
    std::set<std::string> keys;
  };
  std::vector<Frame> stack;
  int line = 1;
  size_t i = 0;
  const size_t n = t.size();
  while (i < n) {
    const char c = t[i];
    if (c == '\n') {
      ++line, ++i;
    } else if (c == '/' && i + 1 < n && t[i + 1] == '/') {  // comments, as the parser allows
      while (i < n && t[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < n && t[i + 1] == '*') {
      for (i += 2; i + 1 < n && !(t[i] == '*' && t[i + 1] == '/'); ++i) line += t[i] == '\n';
      i += 2;
    } else if (c == '{' || c == '[') {
      stack.push_back({c == '{', c == '{', {}});
      ++i;
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      ++i;
    } else if (c == ',') {
      if (!stack.empty() && stack.back().object) stack.back().expect_key = true;
      ++i;
    } else if (c == '"') {
      const size_t start = i++;
      for (; i < n && t[i] != '"'; ++i)
        if (t[i] == '\\') ++i;
      ++i;
      if (!stack.empty() && stack.back().object && stack.back().expect_key) {
        std::string key = t.substr(start, i - start);
        try {
          key = json::parse(key).get<std::string>();
        } catch (const json::exception&) {
        }
        if (!stack.back().keys.insert(key).second) return line;
        stack.back().expect_key = false;
      }
    } else {
      ++i;
    }
  }
  return 0;
}

void ParseContext::fail(const std::string& message) const {
  throw InputError(origin.empty() ? message : origin + ": " + message);
}

ObjectReader::ObjectReader(const json* obj, std::string path, ParseContext& ctx)
    : obj_(obj && !obj->is_null() ? obj : nullptr), path_(std::move(path)), ctx_(ctx) {
  if (obj_ && !obj_->is_object()) {
    if (path_.empty()) ctx_.fail("the config must be a JSON object, got " + describe(*obj_));
    ctx_.fail("'" + path_ + "' must be an object, got " + describe(*obj_));
  }
}

std::string ObjectReader::path_of(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

void ObjectReader::fail(const std::string& key, const std::string& message) const {
  ctx_.fail("'" + path_of(key) + "' " + message);
}

void ObjectReader::type_error(const std::string& key, const json& v, const char* expected) const {
  std::string hint;
  if (v.is_string() && v.get<std::string>() == "auto")
    hint = " ('auto' is filled in by the Hugging Face Trainer, not by DeepSpeed; give a value)";
  fail(key, std::string("must be ") + expected + ", got " + describe(v) + hint);
}

bool ObjectReader::has(const char* key) const {
  return obj_ && obj_->contains(key) && !(*obj_)[key].is_null();
}

const json* ObjectReader::take(const char* key) {
  known_.insert(key);
  return has(key) ? &(*obj_)[key] : nullptr;
}

const json* ObjectReader::find_one(const char* key, std::initializer_list<const char*> aliases,
                                   std::string* used) {
  const json* found = nullptr;
  known_.insert(key);
  for (const char* name : aliases) known_.insert(name);
  if (!obj_) return nullptr;
  std::vector<const char*> names{key};
  names.insert(names.end(), aliases.begin(), aliases.end());
  for (const char* name : names) {
    if (!obj_->contains(name)) continue;
    if (found) fail(name, "repeats '" + path_of(*used) + "' (same setting, another name); give one");
    found = &(*obj_)[name];
    *used = name;
  }
  return found;
}

// Integers may be written as 5e8 (as DeepSpeed's examples do) when the value is whole.
static bool to_int64(const json& j, int64_t& out) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (j.is_number_integer()) return out = j.get<int64_t>(), true;
  if (j.is_number_float()) {
    const double d = j.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) >= 9.2e18) return false;
    return out = static_cast<int64_t>(d), true;
  }
  return false;
}

#define POLYTRAIN_FIND(expected)                     \
  std::string used;                                  \
  const json* j = find_one(key, aliases, &used);     \
  if (!j) return;                                    \
  const char* kExpected = expected;

void ObjectReader::operator()(const char* key, bool& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a boolean (true/false)");
  if (!j->is_boolean()) type_error(used, *j, kExpected);
  v = j->get<bool>();
}

void ObjectReader::operator()(const char* key, int64_t& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("an integer");
  if (!to_int64(*j, v)) type_error(used, *j, kExpected);
}

void ObjectReader::operator()(const char* key, int& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("an integer");
  int64_t w = 0;
  if (!to_int64(*j, w) || w < INT_MIN || w > INT_MAX) type_error(used, *j, kExpected);
  v = static_cast<int>(w);
}

void ObjectReader::operator()(const char* key, uint64_t& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a non-negative integer");
  if (j->is_number_unsigned()) return void(v = j->get<uint64_t>());
  int64_t w = 0;
  if (!to_int64(*j, w) || w < 0) type_error(used, *j, kExpected);
  v = static_cast<uint64_t>(w);
}

void ObjectReader::operator()(const char* key, double& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a number");
  if (!j->is_number()) type_error(used, *j, kExpected);
  v = j->get<double>();
}

void ObjectReader::operator()(const char* key, std::string& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a string");
  if (!j->is_string()) type_error(used, *j, kExpected);
  v = j->get<std::string>();
}

void ObjectReader::operator()(const char* key, NullableString v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a string or null");
  if (j->is_null()) return void(v.value.clear());
  if (!j->is_string()) type_error(used, *j, kExpected);
  v.value = j->get<std::string>();
}

void ObjectReader::operator()(const char* key, std::vector<std::string>& v,
                              std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a list of strings");
  if (!j->is_array()) type_error(used, *j, kExpected);
  std::vector<std::string> out;
  for (size_t i = 0; i < j->size(); ++i) {
    if (!(*j)[i].is_string()) type_error(used + "[" + std::to_string(i) + "]", (*j)[i], "a string");
    out.push_back((*j)[i].get<std::string>());
  }
  v = std::move(out);
}

void ObjectReader::operator()(const char* key, std::optional<int64_t>& v,
                              std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("an integer or null");
  int64_t w = 0;
  if (j->is_null()) return void(v.reset());
  if (!to_int64(*j, w)) type_error(used, *j, kExpected);
  v = w;
}
void ObjectReader::operator()(const char* key, std::optional<bool>& v, std::initializer_list<const char*> aliases) {
  POLYTRAIN_FIND("a boolean (true/false) or null");
  if (j->is_null()) return void(v.reset());
  if (!j->is_boolean()) type_error(used, *j, kExpected);
  v = j->get<bool>();
}
#undef POLYTRAIN_FIND

void ObjectReader::pair(const char* key, double& first, double& second) {
  const json* j = take(key);
  if (!j) return;
  if (!j->is_array() || j->size() != 2 || !(*j)[0].is_number() || !(*j)[1].is_number())
    type_error(key, *j, "a list of two numbers");
  first = (*j)[0].get<double>();
  second = (*j)[1].get<double>();
}

void ObjectReader::ignore(const std::vector<IgnoredKey>& table) {
  for (const auto& entry : table) {
    known_.insert(entry.name);
    if (!obj_ || !obj_->contains(entry.name)) continue;
    const json& v = (*obj_)[entry.name];
    bool is_default;
    if (entry.default_json) {
      is_default = v == json::parse(entry.default_json);
    } else {
      is_default = v.is_null() || v == json(false) || (v.is_object() && v.empty()) ||
                   (v.is_object() && v.contains("enabled") && v["enabled"] == json(false));
    }
    if (!is_default && ctx_.ignored) ctx_.ignored->push_back(path_of(entry.name));
  }
}

void ObjectReader::finish(const std::string& note) const {
  if (!obj_) return;
  for (const auto& item : obj_->items()) {
    if (known_.count(item.key())) continue;
    std::string hint = suggest(item.key(), {known_.begin(), known_.end()});
    ctx_.fail("unknown key '" + path_of(item.key()) + "'" + (hint.empty() ? note : hint));
  }
}

json ObjectReader::rest() const {
  json out = json::object();
  if (obj_)
    for (const auto& item : obj_->items())
      if (!known_.count(item.key())) out[item.key()] = item.value();
  return out;
}

void ObjectReader::unit_interval(const char* key, double v, bool open_high) const {
  if (!(v >= 0.0 && (open_high ? v < 1.0 : v <= 1.0)))
    fail(key, ::polytrain::detail::cat("must be in [0, 1", open_high ? ")" : "]", ", got ", v));
}

void ObjectReader::one_of(const char* key, const std::string& v,
                          const std::vector<std::string>& options) const {
  if (std::find(options.begin(), options.end(), v) != options.end()) return;
  std::string list;
  for (const auto& o : options) list += (list.empty() ? "" : ", ") + o;
  fail(key, "must be one of " + list + "; got '" + v + "'" + suggest(v, options));
}

// `FILE:LINE:COL: ` for nlohmann's byte count (1-based, the last character read).
static std::string line_col_prefix(const std::string& text, size_t byte, const std::string& origin) {
  const size_t idx = std::min(byte > 0 ? byte - 1 : 0, text.size());
  const size_t line = 1 + std::count(text.begin(), text.begin() + idx, '\n');
  const size_t nl = idx == 0 ? std::string::npos : text.rfind('\n', idx - 1);
  const size_t col = idx - (nl == std::string::npos ? 0 : nl + 1) + 1;
  return ::polytrain::detail::cat(origin, ":", line, ":", col, ": ");
}

}  // namespace polytrain::config_detail

namespace polytrain {

using config_detail::json;
using detail::cat;

// Declared in config.h; defined here with the other JSON-level tools. Duplicates are caught by
// nlohmann's parser callback, which tracks the path; the line comes from duplicate_key_line.
json parse_json_strict(const std::string& text, const std::string& origin) {
  struct Frame {
    bool array;
    std::set<std::string> keys;
    std::string key;
    size_t index = 0;
  };
  std::vector<Frame> stack;
  json::parser_callback_t on_event = [&](int, json::parse_event_t ev, json& parsed) {
    using E = json::parse_event_t;
    if (ev == E::object_start || ev == E::array_start) {
      stack.push_back({ev == E::array_start, {}, "", 0});
    } else if (ev == E::key) {
      Frame& f = stack.back();
      f.key = parsed.get<std::string>();
      if (!f.keys.insert(f.key).second) {
        std::string path;
        for (const Frame& fr : stack)
          path += fr.array ? cat("[", fr.index, "]") : (path.empty() ? "" : ".") + fr.key;
        const int line = config_detail::duplicate_key_line(text);
        throw InputError(cat(origin, line > 0 ? cat(":", line) : "", ": duplicate key '", path, "'"));
      }
    } else if (ev == E::object_end || ev == E::array_end) {
      stack.pop_back();
      if (!stack.empty() && stack.back().array) ++stack.back().index;
    } else if (ev == E::value && !stack.empty() && stack.back().array) {
      ++stack.back().index;
    }
    return true;
  };
  try {
    return json::parse(text, on_event, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    std::string msg = e.what();
    const size_t column = msg.find("column ");
    const size_t colon = msg.find(": ", column == std::string::npos ? 0 : column);
    if (colon != std::string::npos) msg = msg.substr(colon + 2);
    throw InputError(config_detail::line_col_prefix(text, e.byte, origin) + msg);
  } catch (const json::exception& e) {  // out_of_range 406: "number overflow parsing '1e999'"
    std::string msg = e.what();
    if (msg.rfind("[json.exception.", 0) == 0 && msg.find("] ") != std::string::npos) msg = msg.substr(msg.find("] ") + 2);
    size_t at = std::string::npos;
    const size_t q = msg.find('\'');
    if (q != std::string::npos && msg.find('\'', q + 1) != std::string::npos) {
      at = text.find(msg.substr(q + 1, msg.find('\'', q + 1) - q - 1));
    }
    throw InputError((at == std::string::npos ? origin + ": " : config_detail::line_col_prefix(text, at + 1, origin)) + msg +
                     (msg.find("overflow") != std::string::npos ? " (out of the range of a double)" : ""));
  }
}

}  // namespace polytrain
