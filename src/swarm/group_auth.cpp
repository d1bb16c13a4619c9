#include "polytrain/swarm/group_auth.h"

#include <algorithm>
#include <cmath>

#include "polytrain/swarm/matchmaking.h"
#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kMaxId = 128, kMaxKey = 256, kMaxAddress = 256, kSignature = 64;
// Each signature covers its own domain first: a join, a list and a hello can never be taken for
// one another, nor for a DHT record.
const std::string kJoinDomain = "polytrain/hivemind/join";
const std::string kGroupDomain = "polytrain/hivemind/group";
const std::string kHelloDomain = "polytrain/hivemind/hello";

bool same_member(const Member& a, const Member& b) {
  return a.peer_id == b.peer_id && a.address == b.address && a.auxiliary == b.auxiliary &&
         std::min(a.bandwidth, kMaxDeclaredBandwidth) == std::min(b.bandwidth, kMaxDeclaredBandwidth);
}

// Why follower entry `m` does not match a join it could have sent to `leader` for `key` ("" when it does).
std::string check_follower(const Member& m, const std::string& key, const std::string& leader) {
  const auto j = open_join(m.join);
  if (!j) return "member " + m.peer_id.substr(0, 16) + " has no join signed by it";
  if (j->key != key || j->leader != leader) return "member " + m.peer_id.substr(0, 16) + " joined another round or leader";
  if (!same_member(j->member, m)) return "member " + m.peer_id.substr(0, 16) + " differs from its signed join";
  return "";
}

}  // namespace

bool parse_peer_id(const std::string& hex, PublicKey& out) {
  if (hex.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[2 * i + k];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else return false;
    }
    out[i] = static_cast<uint8_t>(v);
  }
  return true;
}

std::string seal_join(const Join& j, const Identity& id) {
  std::string s;
  put_str(s, j.key);
  put_str(s, id.peer_id());
  put_str(s, j.member.address);
  put_f64(s, j.member.bandwidth);
  put_u32(s, j.member.auxiliary ? 1 : 0);
  put_u64(s, static_cast<uint64_t>(j.expiration_ms));
  put_str(s, j.leader);
  put_str(s, id.sign(kJoinDomain + s));
  return s;
}

std::optional<Join> open_join(std::string_view bytes) {
  try {
    Reader rd(bytes);
    Join j;
    j.key = rd.str(kMaxKey);
    j.member.peer_id = rd.str(kMaxId);
    j.member.address = rd.str(kMaxAddress);
    j.member.bandwidth = rd.f64();
    const uint32_t aux = rd.u32();
    j.member.auxiliary = aux == 1;
    j.expiration_ms = static_cast<int64_t>(rd.u64());
    j.leader = rd.str(kMaxId);
    const size_t signed_bytes = bytes.size() - rd.rest().size();
    const std::string sig = rd.str(kSignature);
    PublicKey owner{};
    // An auxiliary peer reduces a part: it must accept streams and declare a bandwidth.
    const bool valid = rd.done() && parse_peer_id(j.member.peer_id, owner) && std::isfinite(j.member.bandwidth) &&
                       j.member.bandwidth >= 0 && aux <= 1 && j.expiration_ms >= 0 &&
                       (!j.member.auxiliary || (!j.member.address.empty() && j.member.bandwidth > 0)) &&
                       verify_signature(owner, kJoinDomain + std::string(bytes.substr(0, signed_bytes)), sig);
    if (!valid) return std::nullopt;
    return j;
  } catch (const NetError&) {
    return std::nullopt;  // truncated or oversized fields
  }
}

std::string seal_group(const Group& g, const Identity& leader) {
  std::string s;
  const std::string body = encode_group(g);
  put_str(s, body);
  put_str(s, leader.sign(kGroupDomain + body));
  return s;
}

size_t max_sealed_group_bytes(size_t members) {
  // Per member: its entry (id, address, bandwidth, mode) and a join of at most the same plus key,
  // expiration, leader id and signature; length prefixes included.
  const size_t entry = 4 + kMaxId + 4 + kMaxAddress + 8 + 4;
  const size_t join = entry + 4 + kMaxKey + 8 + 4 + kMaxId + 4 + kSignature;
  return members * (entry + 4 + join) + kMaxKey + 64 + 4 + kSignature;
}

OpenedGroup open_group(std::string_view sealed, const LeaderView& leader, const std::string& key,
                       const std::string& self_id, size_t max_members) {
  OpenedGroup out;
  std::string body, sig;
  try {
    Reader rd(sealed);
    body = rd.str(max_sealed_group_bytes(max_members));
    sig = rd.str(kSignature);
    if (!rd.done()) return out.why = "trailing bytes", out;
  } catch (const NetError&) {
    return out.why = "malformed or larger than " + std::to_string(max_members) + " members", out;
  }
  PublicKey leader_key{};
  if (!parse_peer_id(leader.peer_id, leader_key) || !verify_signature(leader_key, kGroupDomain + body, sig))
    return out.why = "not signed by the leader", out;
  auto g = decode_group(body, self_id);
  if (!g) return out.why = "malformed, or this peer is not in it", out;
  if (g->members.size() > max_members) return out.why = "more members than target_group_size", out;
  const Member& first = g->members[0];
  if (!first.join.empty() || !same_member(first, Member{leader.peer_id, leader.address, leader.bandwidth, first.auxiliary, {}}))
    return out.why = "the leader's entry differs from its signed declaration", out;
  for (size_t i = 1; i < g->members.size(); ++i) {
    out.why = check_follower(g->members[i], key, leader.peer_id);
    if (!out.why.empty()) return out;
  }
  out.group = std::move(g);
  return out;
}

std::string sign_hello(const Identity& sender, const std::string& receiver_id, std::string_view hello) {
  std::string m = kHelloDomain;
  put_str(m, receiver_id);
  m.append(hello);
  return sender.sign(m);
}

bool hello_signed_by(const std::string& sender_id, const std::string& receiver_id, std::string_view hello,
                     std::string_view signature) {
  PublicKey key{};
  if (!parse_peer_id(sender_id, key)) return false;
  std::string m = kHelloDomain;
  put_str(m, receiver_id);
  m.append(hello);
  return verify_signature(key, m, signature);
}

}  // namespace polytrain::hivemind
