// Reading the small msgpack arrays that swarm records carry (progress, metrics): one array of
// exactly N fields, nothing after it, integers within 2^53, numbers finite. Internal to the
// hivemind sources (includes <msgpack.hpp>); every failure is "not this record" (nullopt).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <msgpack.hpp>

namespace polytrain::hivemind::fields {

/// Whether `data[0, size)` is exactly one msgpack value that its own bytes can back: every
/// array element and every map key and value takes at least one byte, so the elements
/// declared over the whole value add up to at most `size`; nesting stays within `max_depth`;
/// nothing follows the value. Checked by a visitor that allocates nothing, before any
/// msgpack::unpack: a 5-byte header declaring 2^28 elements would otherwise make unpack
/// reserve 2^28 objects (6 GiB) up front. After this check unpack allocates at most
/// sizeof(msgpack::object) per input byte.
inline bool bounded_msgpack(const char* data, size_t size, int max_depth = 32) {
  struct Budget : msgpack::null_visitor {
    size_t left = 0;
    int depth = 0, max_depth = 0;
    bool start_array(uint32_t n) {
      if (n > left || ++depth > max_depth) return false;
      left -= n;
      return true;
    }
    bool end_array() { return --depth, true; }
    bool start_map(uint32_t n) {
      if (n > left / 2 || ++depth > max_depth) return false;
      left -= 2 * static_cast<size_t>(n);
      return true;
    }
    bool end_map() { return --depth, true; }
  } budget;
  budget.left = size;
  budget.max_depth = max_depth;
  size_t off = 0;
  return size > 0 && msgpack::parse(data, size, off, budget) && off == size;
}

/// The array of exactly `n` fields that is all of `payload`, or nullopt; `hold` keeps it alive.
inline const msgpack::object* array_of(const std::string& payload, uint32_t n, msgpack::object_handle& hold) {
  size_t off = 0;
  hold = msgpack::unpack(payload.data(), payload.size(), off, nullptr, nullptr, msgpack::unpack_limit(n, 0, 0, 0, 0, 1));
  if (off != payload.size()) return nullptr;
  const auto& o = hold.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size != n) return nullptr;
  return o.via.array.ptr;
}

/// A non-negative integer of at most 2^53 (exact in a double).
inline bool as_int(const msgpack::object& x, int64_t& v) {
  if (x.type != msgpack::type::POSITIVE_INTEGER || x.via.u64 > (uint64_t{1} << 53)) return false;
  v = static_cast<int64_t>(x.via.u64);
  return true;
}

/// A finite number (float or non-negative integer); negative only when `signed_ok`.
inline bool as_num(const msgpack::object& x, double& v, bool signed_ok = false) {
  if (x.type == msgpack::type::FLOAT64 || x.type == msgpack::type::FLOAT32) {
    v = x.via.f64;
  } else if (x.type == msgpack::type::POSITIVE_INTEGER) {
    v = static_cast<double>(x.via.u64);
  } else {
    return false;
  }
  return std::isfinite(v) && (signed_ok || v >= 0.0);
}

}  // namespace polytrain::hivemind::fields
