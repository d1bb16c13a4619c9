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
