// What authenticates a round: the signed join a follower sends its leader, the leader's signed
// group list made of those joins, and the signature over each averaging stream's hello. No torch.
//
// Protocol (all Ed25519, a peer's id is the hex of its public key, see record.h):
//  - a join (kMsgJoin) is the follower's (round key, peer id, address, bandwidth, auxiliary,
//    expiration, leader id) signed by the follower: nobody joins under another's name, or for
//    another leader or round;
//  - the leader's list (kMsgBegin) carries, for every follower, that follower's join bytes as
//    it received them, and the leader's own entry; the leader signs the whole list. A follower
//    checks the leader's signature with the key of the leader it joined, the leader's entry
//    against the leader's signed declaration, and every other entry against its join: a leader
//    cannot add a member that never asked to join it for this round, or change a member's
//    address, bandwidth or mode;
//  - each averaging stream's hello is signed by its sender over the receiver's id and the hello
//    (group id, sender and part index, length, codec, weight, chunk size): a reducer whose
//    group came from matchmaking accepts a stream for index i only with member i's signature.
// Not covered: the chunks themselves (a network attacker that can rewrite TCP streams can alter
// them), and a join replayed by its leader to the same leader and round (the member did ask).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/record.h"

namespace polytrain::hivemind {

/// The public key of a peer id (64 lower-case hex digits); false when it is not one.
bool parse_peer_id(const std::string& hex, PublicKey& out);

/// A follower's request to join a leader's group in one round.
struct Join {
  std::string key;  ///< the round's DHT key
  Member member;    ///< member.join stays empty here
  int64_t expiration_ms = 0;
  std::string leader;  ///< the leader's peer id
};

/// The signed wire form of `j` (j.member.peer_id must be `id`'s).
std::string seal_join(const Join& j, const Identity& id);
/// The join in `bytes` when it is well formed and signed by the peer it names; bandwidth is not
/// clamped here (the signature covers what was sent).
std::optional<Join> open_join(std::string_view bytes);

/// The leader's kMsgBegin payload: the group (every follower with its join) and the leader's
/// signature over it. g.members[0] is the leader.
std::string seal_group(const Group& g, const Identity& leader);

/// What a follower knows of the leader it joined: its signed declaration.
struct LeaderView {
  std::string peer_id, address;
  double bandwidth = 1.0;
};

/// The group in a leader's sealed list, or why it is refused: `why` empty when it verifies
/// (leader signature, leader entry, every follower's join for `key` and this leader, this peer
/// present, at most `max_members`). `group->identity` is left for the caller.
struct OpenedGroup {
  std::optional<Group> group;
  std::string why;
};
OpenedGroup open_group(std::string_view sealed, const LeaderView& leader, const std::string& key,
                       const std::string& self_id, size_t max_members);

/// The most bytes a sealed list of `members` members can take (for the follower's frame limit).
size_t max_sealed_group_bytes(size_t members);

/// The signature a sender puts after its hello to the member `receiver_id`.
std::string sign_hello(const Identity& sender, const std::string& receiver_id, std::string_view hello);
/// Whether `signature` is `sender_id`'s signature of `hello` to `receiver_id`.
bool hello_signed_by(const std::string& sender_id, const std::string& receiver_id, std::string_view hello,
                     std::string_view signature);

}  // namespace polytrain::hivemind
