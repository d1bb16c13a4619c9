#include "polytrain/swarm/record.h"

#include <sodium.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <msgpack.hpp>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"

namespace polytrain::hivemind {
namespace {

void init_sodium() {
  static const int rc = sodium_init();  // thread-safe, idempotent; -1 only when it cannot start
  PT_CHECK(rc >= 0, "libsodium failed to initialise");
}

// The five signed fields, in wire order.
void pack_fields(msgpack::packer<msgpack::sbuffer>& pk, const Record& r) {
  pk.pack(r.kind);
  pk.pack_bin(r.owner.size());
  pk.pack_bin_body(reinterpret_cast<const char*>(r.owner.data()), r.owner.size());
  pk.pack_uint64(r.counter);
  pk.pack_uint64(static_cast<uint64_t>(r.expiry_ms));
  pk.pack_bin(static_cast<uint32_t>(r.payload.size()));
  pk.pack_bin_body(r.payload.data(), r.payload.size());
}

// The bytes a signature covers: the DHT key, then msgpack [kind, owner, counter, expiry, payload].
std::string signed_bytes(const Record& r, std::string_view dht_key) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(5);
  pack_fields(pk, r);
  std::string out;
  out.reserve(dht_key.size() + buf.size());
  out.append(dht_key).append(buf.data(), buf.size());
  return out;
}

}  // namespace

std::string to_hex(const uint8_t* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) s[2 * i] = digits[data[i] >> 4], s[2 * i + 1] = digits[data[i] & 15];
  return s;
}

Identity Identity::generate() {
  init_sodium();
  Identity id;
  crypto_sign_keypair(id.public_.data(), id.secret_.data());
  return id;
}

Identity Identity::from_seed(const std::array<uint8_t, 32>& seed) {
  init_sodium();
  Identity id;
  crypto_sign_seed_keypair(id.public_.data(), id.secret_.data(), seed.data());
  return id;
}

Identity Identity::load_or_create(const std::string& path) {
  init_sodium();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    Identity id = generate();
    const mode_t old = ::umask(077);  // the secret key is the peer's identity: owner-only
    try {
      atomic_write_file(path, std::string(reinterpret_cast<const char*>(id.secret_.data()), id.secret_.size()));
    } catch (...) {
      ::umask(old);
      throw;
    }
    ::umask(old);
    return id;
  }
  const std::string bytes = read_file(path);
  PT_INPUT_CHECK(bytes.size() == 64, "hivemind.identity_path ", path, ": expected a 64-byte Ed25519 secret key, found ",
                 bytes.size(), " bytes");
  Identity id;
  std::memcpy(id.secret_.data(), bytes.data(), 64);
  crypto_sign_ed25519_sk_to_pk(id.public_.data(), id.secret_.data());
  // An Ed25519 secret key holds its public key in its second half: they must agree.
  PT_INPUT_CHECK(std::memcmp(id.public_.data(), id.secret_.data() + 32, 32) == 0, "hivemind.identity_path ", path,
                 ": not an Ed25519 secret key (its two halves do not match)");
  return id;
}

std::string Identity::sign(std::string_view message) const {
  std::string sig(crypto_sign_BYTES, '\0');
  crypto_sign_detached(reinterpret_cast<unsigned char*>(sig.data()), nullptr,
                       reinterpret_cast<const unsigned char*>(message.data()), message.size(), secret_.data());
  return sig;
}

bool verify_signature(const PublicKey& owner, std::string_view message, std::string_view signature) {
  init_sodium();
  if (signature.size() != crypto_sign_BYTES) return false;
  return crypto_sign_verify_detached(reinterpret_cast<const unsigned char*>(signature.data()),
                                     reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                                     owner.data()) == 0;
}

std::array<uint8_t, 20> digest20(std::string_view data) {
  init_sodium();
  std::array<uint8_t, 20> out{};
  crypto_generichash(out.data(), out.size(), reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                     nullptr, 0);
  return out;
}

const std::vector<std::string>& record_kinds() {
  static const std::vector<std::string> kinds = {"progress", "group", "donor", "metrics", "peer"};
  return kinds;
}

const char* reject_name(Reject r) {
  switch (r) {
    case Reject::kNone: return "accepted";
    case Reject::kOversize: return "oversize";
    case Reject::kMalformed: return "malformed";
    case Reject::kSchema: return "bad schema";
    case Reject::kSignature: return "forged";
    case Reject::kExpired: return "expired";
    case Reject::kFarFuture: return "expiry too far ahead";
    case Reject::kReplay: return "replayed";
    case Reject::kWrongSlot: return "someone else's slot";
    case Reject::kCount: break;
  }
  return "?";
}

std::string seal_record(Record r, const Identity& id, std::string_view dht_key) {
  PT_CHECK(r.payload.size() <= kMaxPayloadBytes, "record payload of ", r.payload.size(), " bytes");
  PT_CHECK(std::find(record_kinds().begin(), record_kinds().end(), r.kind) != record_kinds().end(), "kind ", r.kind);
  r.owner = id.public_key();
  const std::string to_sign = signed_bytes(r, dht_key);
  const std::string sig = id.sign(to_sign);
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(6);
  pack_fields(pk, r);
  pk.pack_bin(static_cast<uint32_t>(sig.size()));
  pk.pack_bin_body(sig.data(), sig.size());
  return std::string(buf.data(), buf.size());
}

Opened open_record(std::string_view bytes, std::string_view dht_key, int64_t now_ms, int64_t max_ttl_ms) {
  Opened out;
  if (bytes.size() > kMaxRecordBytes) return out.why = Reject::kOversize, out;
  msgpack::object_handle oh;
  try {
    size_t off = 0;
    // Limits: one array of 6, no maps, short strings; nesting depth 1.
    oh = msgpack::unpack(bytes.data(), bytes.size(), off, nullptr, nullptr,
                         msgpack::unpack_limit(6, 0, kMaxKindBytes, kMaxPayloadBytes, 0, 1));
    if (off != bytes.size()) return out.why = Reject::kMalformed, out;  // trailing bytes
  } catch (const std::exception&) {
    return out.why = Reject::kMalformed, out;
  }
  const msgpack::object& o = oh.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size != 6) return out.why = Reject::kSchema, out;
  const msgpack::object* f = o.via.array.ptr;
  if (f[0].type != msgpack::type::STR || f[1].type != msgpack::type::BIN || f[1].via.bin.size != 32 ||
      f[2].type != msgpack::type::POSITIVE_INTEGER || f[3].type != msgpack::type::POSITIVE_INTEGER ||
      f[4].type != msgpack::type::BIN || f[5].type != msgpack::type::BIN || f[5].via.bin.size != crypto_sign_BYTES)
    return out.why = Reject::kSchema, out;
  Record r;
  r.kind.assign(f[0].via.str.ptr, f[0].via.str.size);
  if (std::find(record_kinds().begin(), record_kinds().end(), r.kind) == record_kinds().end())
    return out.why = Reject::kSchema, out;
  std::memcpy(r.owner.data(), f[1].via.bin.ptr, 32);
  r.counter = f[2].via.u64;
  if (f[3].via.u64 > static_cast<uint64_t>(INT64_MAX)) return out.why = Reject::kSchema, out;
  r.expiry_ms = static_cast<int64_t>(f[3].via.u64);
  r.payload.assign(f[4].via.bin.ptr, f[4].via.bin.size);
  const std::string_view sig(f[5].via.bin.ptr, f[5].via.bin.size);
  if (!verify_signature(r.owner, signed_bytes(r, dht_key), sig)) return out.why = Reject::kSignature, out;
  if (r.expiry_ms <= now_ms) return out.why = Reject::kExpired, out;
  if (r.expiry_ms - now_ms > max_ttl_ms) return out.why = Reject::kFarFuture, out;
  out.record = std::move(r);
  return out;
}

uint64_t slot_id(const PublicKey& owner, std::string_view kind) {
  std::string s(reinterpret_cast<const char*>(owner.data()), owner.size());
  s.append("/").append(kind);
  const auto d = digest20(s);
  uint64_t id = 0;
  std::memcpy(&id, d.data(), sizeof id);
  return id == 0 ? 1 : id;  // 0 means "no id" to OpenDHT
}

bool ReplayGuard::accept(std::string_view dht_key, const Record& r, int64_t now_ms) {
  std::string slot(dht_key);
  slot.append(reinterpret_cast<const char*>(r.owner.data()), r.owner.size()).append(r.kind);
  std::lock_guard<std::mutex> lock(mu_);
  if (now_ms - last_sweep_ms_ > 10'000) {  // forget slots whose last record expired
    for (auto it = seen_.begin(); it != seen_.end();) it = it->second.second < now_ms ? seen_.erase(it) : std::next(it);
    last_sweep_ms_ = now_ms;
  }
  auto [it, fresh] = seen_.try_emplace(slot, r.counter, r.expiry_ms);
  if (fresh) return true;
  if (r.counter < it->second.first) return false;  // older than what the owner already published
  if (r.counter > it->second.first) it->second = {r.counter, r.expiry_ms};
  return true;  // (the same counter: the same record seen again)
}

size_t ReplayGuard::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.size();
}

void RejectCounts::add(Reject r) {
  std::lock_guard<std::mutex> lock(mu_);
  ++n_[static_cast<size_t>(r)];
}

uint64_t RejectCounts::get(Reject r) const {
  std::lock_guard<std::mutex> lock(mu_);
  return n_[static_cast<size_t>(r)];
}

uint64_t RejectCounts::total() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t t = 0;
  for (size_t i = 1; i < n_.size(); ++i) t += n_[i];
  return t;
}

std::string RejectCounts::summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string s;
  for (size_t i = 1; i < n_.size(); ++i)
    if (n_[i]) s += (s.empty() ? "" : ", ") + std::string(reject_name(static_cast<Reject>(i))) + " " + std::to_string(n_[i]);
  return s;
}

int64_t unix_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

uint64_t next_counter(uint64_t previous) {
  using namespace std::chrono;
  const auto us = static_cast<uint64_t>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
  return std::max(previous + 1, us);
}

}  // namespace polytrain::hivemind
