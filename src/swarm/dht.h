// A swarm's DHT node: OpenDHT (Kademlia over UDP) holding only signed polytrain records
// (record.h). The one translation unit that includes <opendht.h> is dht.cpp. No torch.
//
// Every node, whatever role its peer has, refuses what is not a valid record of the swarm:
// the store and edit policies of the record type open each value (signature, schema, size,
// expiry, owner's slot, increasing counter), and every OpenDHT built-in type is replaced by
// one that stores nothing. OpenDHT 2.4.12 stores a validly signed value of any type without
// asking that policy, and an unsigned value reusing a stored signed one's id then crashes the
// node (its secure edit policy reads a null owner): the node's UDP socket therefore drops
// every put that carries anything but unsigned record-type values (dht.cpp, allowed_packet).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "polytrain/swarm/record.h"

namespace polytrain::hivemind {

struct DhtOptions {
  std::string run_id;                      ///< the swarm: its network id and key prefix
  std::string listen = "0.0.0.0:0";        ///< HOST:PORT the UDP socket binds (port 0: any)
  std::vector<std::string> initial_peers;  ///< HOST:PORT of nodes already in the swarm
  std::chrono::milliseconds bootstrap_timeout{10'000};
};

/// A verified record and where it came from.
struct Found {
  Record record;
};

class DhtNode {
 public:
  /// Binds, starts the node's thread and joins through initial_peers (waits until one of them
  /// answered, up to bootstrap_timeout; InputError naming them when none did). InputError for
  /// an unparsable or unbindable address.
  DhtNode(const DhtOptions& options, std::shared_ptr<const Identity> identity);
  ~DhtNode();  ///< leaves the swarm (bounded: under a second)
  DhtNode(const DhtNode&) = delete;
  DhtNode& operator=(const DhtNode&) = delete;

  /// HOST:PORT other peers pass as initial_peers (the bound address; 0.0.0.0 is reported as
  /// 127.0.0.1).
  std::string address() const;
  /// OpenDHT's network id for the run: peers of other runs are not even talked to.
  uint32_t network_id() const;
  const Identity& identity() const { return *identity_; }

  /// Signs and publishes this peer's record of `kind` under `key` (its previous one there is
  /// replaced), valid for `ttl` (>= 11 s: OpenDHT never completes shorter puts). True once a
  /// node stored it before `deadline`.
  bool store(const std::string& key, const std::string& kind, const std::string& payload,
             std::chrono::milliseconds ttl, std::chrono::milliseconds deadline);

  /// The valid, unexpired records under `key` (newest per owner and kind), gathered until the
  /// search completes or `deadline`. Refused ones are counted in rejected().
  std::vector<Record> fetch(const std::string& key, std::chrono::milliseconds deadline);

  /// Values this node refused to store or return, by reason.
  const RejectCounts& rejected() const;
  /// Nodes in the routing table known to answer.
  unsigned good_nodes() const;

  /// The DHT key's 20 bytes (what records are signed against).
  static std::string key_bytes(const std::string& key);

  struct Impl;

 private:
  std::shared_ptr<const Identity> identity_;
  std::unique_ptr<Impl> impl_;
};

/// Whether a UDP datagram may reach the node's OpenDHT (what every DhtNode asks before
/// OpenDHT parses it): one msgpack value of at most 65507 bytes whose declared arrays, maps,
/// strings and binaries its own bytes back, nested at most 16 deep, nothing after it; and
/// no put of anything but unsigned record values. Parsing it allocates at most ~24 bytes per
/// byte received.
bool datagram_allowed(const uint8_t* data, size_t size);

/// Splits HOST:PORT (IPv4 or a name; [v6]:port); InputError naming `what` when malformed.
std::pair<std::string, uint16_t> split_host_port(const std::string& s, const std::string& what);

}  // namespace polytrain::hivemind
