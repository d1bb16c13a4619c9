// Signed swarm records: what a peer publishes in the DHT (progress, matchmaking declarations,
// state donors, metrics). No torch.
//
// Wire form: a msgpack array [kind, owner, counter, expiry_ms, payload, signature] where
//   kind       str (<= 16 bytes, one of record_kinds()),
//   owner      bin 32: the publisher's Ed25519 public key,
//   counter    uint: strictly increasing per owner (a replayed or reordered record is older),
//   expiry_ms  uint: Unix time in ms after which the record is void,
//   payload    bin (<= kMaxPayload),
//   signature  bin 64: Ed25519 over the DHT key the record is stored under followed by the
//              msgpack encoding of the first five fields (so a record cannot be moved to
//              another key, and no field can be changed).
// Readers and the DHT's store policy both open records with open_record(); OpenDHT's own
// signing is not used (see dht.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace polytrain::hivemind {

using PublicKey = std::array<uint8_t, 32>;

/// Lower-case hex of bytes.
std::string to_hex(const uint8_t* data, size_t n);
inline std::string to_hex(const PublicKey& k) { return to_hex(k.data(), k.size()); }

/// A peer's Ed25519 key pair (libsodium).
class Identity {
 public:
  /// A fresh random key pair.
  static Identity generate();
  /// The key pair in `path` (64-byte secret key), or a new one written there (mode 0600) when
  /// the file does not exist. InputError naming the file when it exists but is not a key.
  static Identity load_or_create(const std::string& path);
  /// A key pair derived from a 32-byte seed (tests: reproducible identities).
  static Identity from_seed(const std::array<uint8_t, 32>& seed);

  const PublicKey& public_key() const { return public_; }
  /// Hex of the public key: the peer id every log line and group uses.
  std::string peer_id() const { return to_hex(public_); }
  /// Ed25519 signature (64 bytes) of `message`.
  std::string sign(std::string_view message) const;

 private:
  PublicKey public_{};
  std::array<uint8_t, 64> secret_{};
};

/// True when `signature` is `owner`'s Ed25519 signature of `message`.
bool verify_signature(const PublicKey& owner, std::string_view message, std::string_view signature);

/// 20-byte digest (BLAKE2b) of a string: the DHT key of `name`, the value id of an owner's slot.
std::array<uint8_t, 20> digest20(std::string_view data);

// OpenDHT 2.4 sends a put's values in one packet only when they total under 600 bytes
// (MAX_PACKET_VALUE_SIZE), and swarm nodes drop values sent in parts (dht.cpp): a record,
// wrapped as an OpenDHT value (~40 bytes more), must stay under that.
constexpr size_t kMaxRecordBytes = 512;   ///< a whole encoded record
constexpr size_t kMaxPayloadBytes = 360;  ///< its payload
constexpr size_t kMaxKindBytes = 16;

/// The kinds a swarm publishes; anything else is refused.
const std::vector<std::string>& record_kinds();

struct Record {
  std::string kind;
  PublicKey owner{};
  uint64_t counter = 0;
  int64_t expiry_ms = 0;
  std::string payload;
};

/// Why a record was refused (kNone: accepted).
enum class Reject { kNone, kOversize, kMalformed, kSchema, kSignature, kExpired, kFarFuture, kReplay, kWrongSlot, kCount };
const char* reject_name(Reject r);

/// The signed wire form of `r` stored under `dht_key` (r.owner is set to id's key).
std::string seal_record(Record r, const Identity& id, std::string_view dht_key);

struct Opened {
  std::optional<Record> record;
  Reject why = Reject::kNone;
};

/// Parses and verifies a record found under `dht_key` at time `now_ms`: size, msgpack schema,
/// kind, signature, not expired and not expiring more than `max_ttl_ms` from now.
Opened open_record(std::string_view bytes, std::string_view dht_key, int64_t now_ms,
                   int64_t max_ttl_ms = 15 * 60 * 1000);

/// The OpenDHT value id of an owner's one slot of `kind` under a key: a peer's newer record
/// replaces its older one there, and nobody else's key can take that slot.
uint64_t slot_id(const PublicKey& owner, std::string_view kind);

/// Per-(key, owner, kind) highest counter seen: a record whose counter is below it is a
/// replay (the same counter is the same record seen again). Entries are forgotten after their record expired (memory bounded by live records).
class ReplayGuard {
 public:
  /// False when `r` is older than a record already seen from its owner under `dht_key`;
  /// otherwise true, remembering its counter.
  bool accept(std::string_view dht_key, const Record& r, int64_t now_ms);
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::pair<uint64_t, int64_t>> seen_;  // slot -> (counter, expiry)
  int64_t last_sweep_ms_ = 0;
};

/// Counts of refused records by reason (thread-safe).
class RejectCounts {
 public:
  void add(Reject r);
  uint64_t get(Reject r) const;
  uint64_t total() const;
  std::string summary() const;  ///< "forged 3, replayed 1, ..." (empty when none)

 private:
  mutable std::mutex mu_;
  std::array<uint64_t, static_cast<size_t>(Reject::kCount)> n_{};
};

/// Milliseconds since the Unix epoch (the clock records' expiries use).
int64_t unix_ms();

/// A counter that increases across restarts: max(previous + 1, Unix time in microseconds).
uint64_t next_counter(uint64_t previous);

}  // namespace polytrain::hivemind
