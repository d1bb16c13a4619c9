// Matchmaking: how peers that are ready to average find each other (hivemind's Matchmaking),
// no torch.
//
// A peer looking for a group declares itself under the round's key (a signed `group` record:
// its address, bandwidth and an expiration `matchmaking_time` from now). Declarations are
// ordered by (expiration, peer id): a peer asks to join the earliest declared peers before it
// (potential leaders), one at a time, each request bounded by `request_timeout`, and accepts
// requests from the peers after it. The leader answers with a refusal code or accepts and
// keeps the stream open; it starts the round (a Group in its order: leader, then followers by
// arrival) when the group reaches target_group_size, when every peer the caller expects has
// joined, or at its own expiration if the group has min_group_size members; otherwise it
// disbands its followers, pointing them to the leader it joined itself when it did. A peer
// that follows a leader refuses requests with NOT_A_LEADER and names its leader.
// Client-mode peers (no inbound connections) declare nothing and only join. An auxiliary peer
// (MatchmakingOptions::auxiliary, hivemind's AUX mode) declares, leads and joins as any other;
// its join request and the group say it is one, so the others send it nothing but its part.
//
// Join requests are signed with the requester's Ed25519 key (its peer id is that key), over
// the leader's id and the round's key, so nobody joins under another peer's name. The leader's
// list carries each follower's join and is signed by the leader; a follower takes it only when
// it verifies (group_auth.h), and never follows a leader whose list did not again.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "polytrain/swarm/butterfly.h"

namespace polytrain::hivemind {

class DhtNode;
class Identity;

/// Frame types of matchmaking (the averaging protocol uses 10-13).
enum : uint8_t { kMsgJoin = 20, kMsgJoinReply = 21, kMsgBegin = 22, kMsgDisband = 23 };

/// The leader's answers to a join request (hivemind's MessageCode names).
enum class JoinCode : uint32_t {
  kAccepted = 0,
  kNotLookingForGroup = 1,  ///< not matchmaking, or for another key
  kNotALeader = 2,          ///< follows another leader (named in the reply)
  kBadExpiration = 3,       ///< the requester declared earlier: it should lead
  kDuplicatePeerId = 4,
  kGroupIsFull = 5,
  kProtocolViolation = 6,   ///< malformed request or bad signature
};
const char* join_code_name(JoinCode c);

struct MatchmakingOptions {
  std::string key;  ///< the round's DHT key, e.g. {run_id}_grad_{epoch}
  std::chrono::milliseconds matchmaking_time{15'000};
  std::chrono::milliseconds request_timeout{3'000};
  size_t min_group_size = 2;
  size_t target_group_size = 256;
  double bandwidth = 1.0;
  /// This peer only reduces (butterfly.h's Member::auxiliary); it must accept streams.
  bool auxiliary = false;
};

/// A declaration as read from the DHT.
struct Declaration {
  std::string peer_id, address;
  double bandwidth = 1.0;
  int64_t expiration_ms = 0;  ///< Unix ms
};
std::string encode_declaration(const Declaration& d);
std::optional<Declaration> decode_declaration(const std::string& payload);

class Matchmaker {
 public:
  /// `address`: where this peer accepts streams ("" = client mode). Registers its join
  /// service on `router`.
  Matchmaker(DhtNode& dht, Router& router, std::shared_ptr<const Identity> identity, std::string address);
  ~Matchmaker();

  /// Looks for a group under o.key until `deadline`; the group (this peer in it) or nothing
  /// when no group of min_group_size formed in time. `expected` (may be empty) gives how many
  /// peers, this one included, are expected in the round: the leader starts once that many
  /// joined instead of waiting for its expiration. `abandon` (may be empty) is asked each time
  /// a declaration expired without a group, before declaring again: true ends the search with
  /// nothing (the round is over elsewhere: retrying until `deadline` would only fall further
  /// behind).
  std::optional<Group> find_group(const MatchmakingOptions& o, const std::function<size_t()>& expected,
                                  Deadline deadline, const std::function<bool()>& abandon = {});

  /// Ends any matchmaking now: followers are released, find_group returns nothing, join
  /// streams being served finish (bounded); call before stopping the server.
  void stop();

  /// Peers this one neither accepts as followers (PROTOCOL_VIOLATION) nor joins as leaders,
  /// e.g. those Averager::offences() banned; empty (the default): none.
  void set_banned(std::function<bool(const std::string&)> banned);

  /// Join requests refused so far, by code (tests, logs).
  uint64_t refused(JoinCode c) const;
  /// Group lists refused so far because they did not verify (group_auth.h's open_group).
  uint64_t forged_lists() const;

 private:
  struct Follower;
  void serve_join(Connection& c, const Frame& f);
  std::optional<Group> try_join(const Declaration& leader, const MatchmakingOptions& o, Deadline deadline,
                                std::string* suggested);
  void disband_locked(const std::string& suggested);
  Group begin_locked();
  bool is_banned(const std::string& peer_id) const;
  bool is_forger(const std::string& peer_id) const;
  /// The group in the leader's sealed list when it verifies; otherwise nothing, and the leader is
  /// never followed again.
  std::optional<Group> begin_as_follower(const Declaration& leader, const MatchmakingOptions& o, const std::string& sealed,
                                         size_t max_members);

  DhtNode& dht_;
  std::shared_ptr<const Identity> id_;
  std::string address_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // The round this peer is matchmaking for (looking_ false: none).
  bool looking_ = false;
  std::string key_;
  int64_t expiration_ms_ = 0;
  size_t target_ = 256;
  double bandwidth_ = 1.0;
  bool auxiliary_ = false;
  uint64_t generation_ = 0;  ///< bumped at every outcome: waiting followers compare it
  std::string leader_;       ///< peer id of the leader this peer follows ("" = none)
  std::vector<std::shared_ptr<Follower>> followers_;
  std::vector<uint64_t> refused_;
  bool stopping_ = false;
  size_t serving_ = 0;  ///< join streams being served (the destructor waits for them)
  std::function<bool(const std::string&)> banned_;
  uint64_t forged_lists_ = 0;
  std::set<std::string> forgers_;
};

/// Group <-> bytes: the body of the leader's kMsgBegin payload (group_auth.h signs it); no
/// signature is checked here.
std::string encode_group(const Group& g);
/// InputError-free: nullopt when malformed or when `self_id` is not a member.
std::optional<Group> decode_group(const std::string& payload, const std::string& self_id);

}  // namespace polytrain::hivemind
