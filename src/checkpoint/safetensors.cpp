// safetensors writer and validating reader. The writer streams tensor bytes into
// atomic_write_file; the reader preads each tensor straight into its CPU storage, so a file
// is never held twice in memory. Assumes a little-endian host, as the format does.
#include "polytrain/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

namespace polytrain {
namespace {

constexpr uint64_t kMaxHeaderSize = 100'000'000;  // the reference reader's limit
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeInfo {
  const char* name;
  int rank;  // position in the reference Dtype enum, which is in increasing alignment order
  size_t itemsize;
  c10::optional<at::ScalarType> scalar_type;  // nullopt: known to the format, not to libtorch
};

const std::vector<DtypeInfo>& dtype_table() {
  static const std::vector<DtypeInfo> kTable = {
      {"BOOL", 0, 1, at::kBool},    {"U8", 1, 1, at::kByte},       {"I8", 2, 1, at::kChar},
      {"F8_E5M2", 3, 1, {}},        {"F8_E4M3", 4, 1, {}},         {"I16", 5, 2, at::kShort},
      {"U16", 6, 2, {}},            {"F16", 7, 2, at::kHalf},      {"BF16", 8, 2, at::kBFloat16},
      {"I32", 9, 4, at::kInt},      {"U32", 10, 4, {}},            {"F32", 11, 4, at::kFloat},
      {"F64", 12, 8, at::kDouble},  {"I64", 13, 8, at::kLong},     {"U64", 14, 8, {}},
  };
  return kTable;
}

const DtypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : dtype_table())
    if (name == d.name) return &d;
  return nullptr;
}

const DtypeInfo* find_dtype(at::ScalarType t) {
  for (const auto& d : dtype_table())
    if (d.scalar_type && *d.scalar_type == t) return &d;
  return nullptr;
}

struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
  at::Tensor tensor;  // writer only
};

}  // namespace

namespace {

// The header text and the entries in file order; `what` names the destination in errors.
struct Prepared {
  std::string text;
  std::vector<Entry> entries;
  uint64_t data_size = 0;
};

Prepared prepare(const std::string& what, const NamedTensors& tensors,
                 const std::map<std::string, std::string>& metadata) {
  Prepared p;
  std::vector<Entry>& entries = p.entries;
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    PT_INPUT_CHECK(name != kMetadataKey, "cannot save ", what, ": tensor name ", kMetadataKey,
                   " is reserved");
    PT_INPUT_CHECK(seen.insert(name).second, "cannot save ", what, ": tensor name ", name,
                   " appears twice");
    PT_INPUT_CHECK(tensor.defined(), "cannot save ", what, ": tensor ", name, " is undefined");
    const DtypeInfo* dtype = find_dtype(tensor.scalar_type());
    PT_INPUT_CHECK(dtype != nullptr, "cannot save ", what, ": tensor ", name, " has dtype ",
                   tensor.scalar_type(), ", which safetensors cannot hold");
    at::Tensor cpu = tensor.to(at::kCPU).contiguous();
    entries.push_back({name, dtype, cpu.sizes().vec(), 0, 0, cpu});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.dtype->rank != b.dtype->rank) return a.dtype->rank > b.dtype->rank;
    return a.name < b.name;
  });

  // ordered_json keeps insertion order, which is the reference writer's order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (auto& e : entries) {
    e.begin = offset;
    e.end = offset + static_cast<uint64_t>(e.tensor.numel()) * e.dtype->itemsize;
    offset = e.end;
    header[e.name] = {{"dtype", e.dtype->name}, {"shape", e.shape},
                      {"data_offsets", {e.begin, e.end}}};
  }
  p.data_size = offset;
  try {
    p.text = header.dump();
  } catch (const nlohmann::json::exception& ex) {
    throw InputError(detail::cat("cannot save ", what, ": ", ex.what()));
  }
  p.text.append((8 - p.text.size() % 8) % 8, ' ');
  return p;
}

// Writes the file's bytes in order through `write(const char*, size_t)`.
template <typename Write>
void emit(const Prepared& p, Write&& write) {
  char size_le[8];
  const uint64_t n = p.text.size();
  std::memcpy(size_le, &n, 8);
  write(size_le, 8);
  write(p.text.data(), p.text.size());
  for (const auto& e : p.entries)
    write(static_cast<const char*>(e.tensor.data_ptr()), static_cast<size_t>(e.end - e.begin));
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const Prepared p = prepare(path, tensors, metadata);
  atomic_write_file(path, [&](std::ostream& os) {
    emit(p, [&](const char* data, size_t n) { os.write(data, static_cast<std::streamsize>(n)); });
  });
}

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                              const std::string& what) {
  const Prepared p = prepare(what, tensors, metadata);
  std::string out;
  out.reserve(8 + p.text.size() + p.data_size);
  emit(p, [&](const char* data, size_t n) { out.append(data, n); });
  return out;
}

namespace {

// Reads exactly n bytes at offset; InputError if the file ends first.
void pread_all(int fd, const std::string& path, void* dst, uint64_t n, uint64_t offset) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min<uint64_t>(n, 1 << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    PT_INPUT_CHECK(r >= 0, "cannot read ", path, ": ", std::strerror(errno));
    PT_INPUT_CHECK(r > 0, "cannot read ", path, ": file ended early");
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

struct Fd {
  int fd;
  ~Fd() { ::close(fd); }
};

// Parses one tensor's header entry; `bad` prefixes every error.
Entry parse_entry(const std::string& name, const nlohmann::json& info, const std::string& bad) {
  const std::string where = bad + "tensor " + name + ": ";
  PT_INPUT_CHECK(info.is_object(), where, "entry is not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    PT_INPUT_CHECK(info.contains(key), where, "no \"", key, "\"");
  const auto& dtype_json = info["dtype"];
  PT_INPUT_CHECK(dtype_json.is_string(), where, "dtype is not a string");
  const std::string dtype_name = dtype_json.get<std::string>();
  const DtypeInfo* dtype = find_dtype(dtype_name);
  PT_INPUT_CHECK(dtype != nullptr, where, "unknown dtype ", dtype_name);
  PT_INPUT_CHECK(dtype->scalar_type.has_value(), where, "dtype ", dtype_name,
                 " has no libtorch equivalent");

  Entry e{name, dtype, {}, 0, 0, {}};
  const auto& shape = info["shape"];
  PT_INPUT_CHECK(shape.is_array(), where, "shape is not an array");
  uint64_t numel = 1;
  bool overflow = false;
  for (const auto& d : shape) {
    PT_INPUT_CHECK(d.is_number_unsigned(), where, "shape holds ", d.dump(),
                   ", not a non-negative integer");
    const uint64_t v = d.get<uint64_t>();
    PT_INPUT_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where,
                   "dimension ", v, " too large");
    if (v != 0 && numel > std::numeric_limits<uint64_t>::max() / v) overflow = true;
    numel *= v;
    e.shape.push_back(static_cast<int64_t>(v));
  }
  const auto& off = info["data_offsets"];
  PT_INPUT_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                     off[1].is_number_unsigned(),
                 where, "data_offsets is not [begin, end]: ", off.dump());
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  PT_INPUT_CHECK(e.end >= e.begin, where, "data_offsets [", e.begin, ", ", e.end,
                 "] end before they begin");
  PT_INPUT_CHECK(!overflow && numel <= std::numeric_limits<uint64_t>::max() / dtype->itemsize,
                 where, "shape ", shape.dump(), " overflows");
  PT_INPUT_CHECK(numel * dtype->itemsize == e.end - e.begin, where, "shape ", shape.dump(),
                 " x ", dtype->itemsize, " bytes != ", e.end - e.begin,
                 " bytes of data_offsets");
  return e;
}

}  // namespace

namespace {

// The validating reader over a source of `size` bytes: `read(dst, n, offset)` copies bytes
// [offset, offset + n) of it. `bad` prefixes every error.
NamedTensors parse_impl(const std::string& bad, uint64_t size,
                        const std::function<void(void*, uint64_t, uint64_t)>& read,
                        std::map<std::string, std::string>* metadata) {
  PT_INPUT_CHECK(size >= 8, bad, "it is ", size, " bytes, too short for the ", "8-byte header size");
  uint64_t n = 0;
  read(&n, 8, 0);
  PT_INPUT_CHECK(n <= kMaxHeaderSize, bad, "header size ", n, " exceeds the limit of ",
                 kMaxHeaderSize);
  PT_INPUT_CHECK(n <= size - 8, bad, "header size ", n, " runs past the end of the ",
                 size, " bytes");
  std::string text(n, '\0');
  read(text.data(), n, 8);
  PT_INPUT_CHECK(!text.empty() && text[0] == '{', bad, "header does not start with '{'");

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& ex) {
    throw InputError(detail::cat(bad, "header is not valid JSON: ", ex.what()));
  }
  PT_INPUT_CHECK(header.is_object(), bad, "header is not a JSON object");

  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      PT_INPUT_CHECK(value.is_object(), bad, kMetadataKey, " is not an object");
      for (const auto& [mk, mv] : value.items()) {
        PT_INPUT_CHECK(mv.is_string(), bad, kMetadataKey, " value of ", mk,
                       " is not a string");
        if (metadata) (*metadata)[mk] = mv.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(key, value, bad));
  }

  // Data offsets must tile [0, data size) in order, with no gap or overlap.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  const uint64_t data_size = size - 8 - n;
  uint64_t expected = 0;
  for (const auto& e : entries) {
    PT_INPUT_CHECK(e.begin == expected, bad, "tensor ", e.name, " has data_offsets [", e.begin,
                   ", ", e.end, "] but the previous tensor ends at ", expected,
                   " (offsets must be contiguous, without overlap)");
    expected = e.end;
  }
  PT_INPUT_CHECK(expected == data_size, bad, "tensors cover ", expected,
                 " bytes but the data area is ", data_size, " bytes");

  NamedTensors out;
  out.reserve(entries.size());
  for (const auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(*e.dtype->scalar_type));
    if (e.end > e.begin) read(t.data_ptr(), e.end - e.begin, 8 + n + e.begin);
    if (e.dtype->scalar_type == at::kBool) {
      // A byte other than 0/1 is not a valid bool for libtorch.
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      for (int64_t i = 0; i < t.numel(); ++i)
        PT_INPUT_CHECK(b[i] <= 1, bad, "tensor ", e.name, " holds bool byte ", int(b[i]));
    }
    out.emplace_back(e.name, std::move(t));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace

NamedTensors load_safetensors(const std::string& path,
                              std::map<std::string, std::string>* metadata) {
  Fd file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  PT_INPUT_CHECK(file.fd >= 0, "cannot read ", path, ": ", std::strerror(errno));
  struct stat st;
  PT_INPUT_CHECK(::fstat(file.fd, &st) == 0 && S_ISREG(st.st_mode), "cannot read ", path,
                 ": not a regular file");
  return parse_impl("invalid safetensors file " + path + ": ", static_cast<uint64_t>(st.st_size),
                    [&](void* dst, uint64_t n, uint64_t offset) { pread_all(file.fd, path, dst, n, offset); },
                    metadata);
}

NamedTensors parse_safetensors(std::string_view bytes, const std::string& what,
                               std::map<std::string, std::string>* metadata) {
  return parse_impl(what + ": invalid safetensors data: ", bytes.size(),
                    [&](void* dst, uint64_t n, uint64_t offset) {
                      // parse_impl reads only inside the size it was given; checked anyway.
                      PT_CHECK(offset <= bytes.size() && n <= bytes.size() - offset, "safetensors read out of range");
                      std::memcpy(dst, bytes.data() + offset, n);
                    },
                    metadata);
}

}  // namespace polytrain
