#include "polytrain/swarm/matchmaking.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <tuple>

#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/group_auth.h"
#include "polytrain/swarm/record.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kMaxId = 128, kMaxKey = 256, kMaxAddress = 256, kMaxMembers = 4096;
constexpr size_t kMaxJoin = 1024;  ///< a signed join (group_auth.h): its fields' limits and a signature
// Leaders whose lists did not verify, remembered for the run (never joined again) up to this many.
constexpr size_t kMaxForgers = 1024;

// A Unix-ms time as a steady-clock deadline.
Deadline steady_at(int64_t unix_time_ms) {
  return Clock::now() + std::chrono::milliseconds(unix_time_ms - unix_ms());
}

// (expiration, peer id): the order that picks leaders.
bool earlier(int64_t exp_a, const std::string& id_a, int64_t exp_b, const std::string& id_b) {
  return std::tie(exp_a, id_a) < std::tie(exp_b, id_b);
}

}  // namespace

const char* join_code_name(JoinCode c) {
  switch (c) {
    case JoinCode::kAccepted: return "ACCEPTED";
    case JoinCode::kNotLookingForGroup: return "NOT_LOOKING_FOR_GROUP";
    case JoinCode::kNotALeader: return "NOT_A_LEADER";
    case JoinCode::kBadExpiration: return "BAD_EXPIRATION_TIME";
    case JoinCode::kDuplicatePeerId: return "DUPLICATE_PEER_ID";
    case JoinCode::kGroupIsFull: return "GROUP_IS_FULL";
    case JoinCode::kProtocolViolation: return "PROTOCOL_VIOLATION";
  }
  return "UNKNOWN";
}

std::string encode_declaration(const Declaration& d) {
  std::string s;
  put_str(s, d.address);
  put_f64(s, d.bandwidth);
  put_u64(s, static_cast<uint64_t>(d.expiration_ms));
  return s;
}

std::optional<Declaration> decode_declaration(const std::string& payload) {
  try {
    Reader rd(payload);
    Declaration d;
    d.address = rd.str(kMaxAddress);
    d.bandwidth = rd.f64();
    d.expiration_ms = static_cast<int64_t>(rd.u64());
    if (!rd.done() || d.address.empty() || !(d.bandwidth > 0) || !std::isfinite(d.bandwidth) || d.expiration_ms < 0)
      return std::nullopt;
    d.bandwidth = std::min(d.bandwidth, kMaxDeclaredBandwidth);
    return d;
  } catch (const NetError&) {
    return std::nullopt;
  }
}

std::string encode_group(const Group& g) {
  std::string s;
  put_str(s, g.group_id);
  put_u32(s, static_cast<uint32_t>(g.members.size()));
  for (const auto& m : g.members) {
    put_str(s, m.peer_id);
    put_str(s, m.address);
    put_f64(s, m.bandwidth);
    put_u32(s, m.auxiliary ? 1 : 0);
    put_str(s, m.join);
  }
  return s;
}

std::optional<Group> decode_group(const std::string& payload, const std::string& self_id) {
  try {
    Reader rd(payload);
    Group g;
    g.group_id = rd.str(kMaxKey);
    const uint32_t n = rd.u32();
    if (n == 0 || n > kMaxMembers) return std::nullopt;
    std::set<std::string> ids;
    bool found = false, reducer = false;
    for (uint32_t i = 0; i < n; ++i) {
      Member m;
      m.peer_id = rd.str(kMaxId);
      m.address = rd.str(kMaxAddress);
      m.bandwidth = std::min(rd.f64(), kMaxDeclaredBandwidth);  // the same clamp on every member
      const uint32_t aux = rd.u32();
      m.auxiliary = aux == 1;
      m.join = rd.str(kMaxJoin);
      if (!ids.insert(m.peer_id).second || !std::isfinite(m.bandwidth) || m.bandwidth < 0 || aux > 1 ||
          (m.auxiliary && (m.address.empty() || !(m.bandwidth > 0))))
        return std::nullopt;
      reducer = reducer || (!m.address.empty() && m.bandwidth > 0);
      if (m.peer_id == self_id) g.self = i, found = true;
      g.members.push_back(std::move(m));
    }
    if (!rd.done() || !found || !reducer) return std::nullopt;
    return g;
  } catch (const NetError&) {
    return std::nullopt;
  }
}

struct Matchmaker::Follower {
  Member member;
  bool done = false;
  bool begun = false;
  std::string payload;  ///< the group (begun) or the suggested leader (disbanded)
};

Matchmaker::Matchmaker(DhtNode& dht, Router& router, std::shared_ptr<const Identity> identity, std::string address)
    : dht_(dht), id_(std::move(identity)), address_(std::move(address)), refused_(8, 0) {
  router.on(kMsgJoin, [this](Connection& c, const Frame& f) { serve_join(c, f); });
}

Matchmaker::~Matchmaker() { stop(); }

void Matchmaker::stop() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  looking_ = false;
  disband_locked("");
  cv_.notify_all();
  cv_.wait_for(lock, std::chrono::seconds(2), [&] { return serving_ == 0; });
}

void Matchmaker::set_banned(std::function<bool(const std::string&)> banned) {
  std::lock_guard<std::mutex> lock(mu_);
  banned_ = std::move(banned);
}

bool Matchmaker::is_banned(const std::string& peer_id) const {
  std::function<bool(const std::string&)> banned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    banned = banned_;
  }
  return banned && banned(peer_id);
}

uint64_t Matchmaker::refused(JoinCode c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_.at(static_cast<size_t>(c));
}

void Matchmaker::disband_locked(const std::string& suggested) {
  for (auto& f : followers_) f->done = true, f->begun = false, f->payload = suggested;
  followers_.clear();
  ++generation_;
  cv_.notify_all();
}

Group Matchmaker::begin_locked() {
  Group g;
  g.group_id = id_->peer_id().substr(0, 16) + "/" + key_ + "/" + std::to_string(next_counter(0));
  g.members.push_back(Member{id_->peer_id(), address_, bandwidth_, auxiliary_, {}});
  for (const auto& f : followers_) g.members.push_back(f->member);
  g.self = 0;
  g.identity = id_;
  const std::string bytes = seal_group(g, *id_);
  for (auto& f : followers_) f->done = true, f->begun = true, f->payload = bytes;
  followers_.clear();
  looking_ = false;
  ++generation_;
  cv_.notify_all();
  return g;
}

void Matchmaker::serve_join(Connection& c, const Frame& f) {
  const Deadline reply_by = after(std::chrono::milliseconds(3000));
  auto reply = [&](JoinCode code, const std::string& suggested) {
    std::string s;
    put_u32(s, static_cast<uint32_t>(code));
    put_str(s, suggested);
    c.send(kMsgJoinReply, s, reply_by);
  };
  Member m;
  int64_t expiration = 0;
  try {
    std::string key;
    const auto join = f.payload.size() <= kMaxJoin ? open_join(f.payload) : std::nullopt;
    bool valid = join && join->leader == id_->peer_id();
    if (valid) {
      key = join->key, m = join->member, expiration = join->expiration_ms;
      m.join = f.payload;  // the leader's list carries it, for every follower to check
    }
    // Clamped after the signature check (which covers the declared value): one member's 1e300
    // would otherwise dominate every sum of bandwidths the group computes.
    m.bandwidth = std::min(m.bandwidth, kMaxDeclaredBandwidth);
    // A peer banned for poisoning this peer's parts is not taken into its groups again.
    valid = valid && !is_banned(m.peer_id);
    if (!valid) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++refused_[static_cast<size_t>(JoinCode::kProtocolViolation)];
      }
      return reply(JoinCode::kProtocolViolation, "");
    }
    auto follower = std::make_shared<Follower>();
    follower->member = m;
    int64_t my_expiration = 0;
    JoinCode code = JoinCode::kAccepted;
    std::string suggested;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const bool client = m.address.empty();
      if (!looking_ || stopping_ || key != key_) code = JoinCode::kNotLookingForGroup;
      else if (!leader_.empty()) code = JoinCode::kNotALeader, suggested = leader_;
      else if (!client && earlier(expiration, m.peer_id, expiration_ms_, id_->peer_id())) code = JoinCode::kBadExpiration;
      else if (m.peer_id == id_->peer_id() ||
               std::any_of(followers_.begin(), followers_.end(), [&](const auto& x) { return x->member.peer_id == m.peer_id; }))
        code = JoinCode::kDuplicatePeerId;
      else if (followers_.size() + 1 >= target_) code = JoinCode::kGroupIsFull;
      if (code != JoinCode::kAccepted) {
        ++refused_[static_cast<size_t>(code)];
      } else {
        followers_.push_back(follower);
        ++serving_;
        my_expiration = expiration_ms_;
        cv_.notify_all();
      }
    }
    if (code != JoinCode::kAccepted) return reply(code, suggested);
    struct Leave {  // serving_ is decremented however this ends
      Matchmaker* mm;
      ~Leave() {
        std::lock_guard<std::mutex> lock(mm->mu_);
        --mm->serving_;
        mm->cv_.notify_all();
      }
    } leave{this};
    reply(JoinCode::kAccepted, "");
    // Wait for the group to begin or disband: at the latest at our expiration plus a request
    // timeout (the leader loop decides by its expiration).
    bool begun = false;
    std::string payload;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, steady_at(my_expiration) + std::chrono::milliseconds(3000),
                     [&] { return follower->done || stopping_; });
      if (!follower->done) {  // timed out or stopping: take it out of the group
        followers_.erase(std::remove(followers_.begin(), followers_.end(), follower), followers_.end());
        follower->done = true;
      }
      begun = follower->begun;
      payload = follower->payload;
    }
    c.send(begun ? kMsgBegin : kMsgDisband, payload, after(std::chrono::milliseconds(3000)));
  } catch (const NetError&) {
    // The requester went away or sent garbage: nothing to answer.
  }
}

std::optional<Group> Matchmaker::try_join(const Declaration& leader, const MatchmakingOptions& o, Deadline deadline,
                                          std::string* suggested) {
  suggested->clear();
  try {
    auto conn = Connection::connect(leader.address, std::min(deadline, after(o.request_timeout)));
    Join join;
    join.key = o.key;
    join.member = Member{id_->peer_id(), address_, bandwidth_, auxiliary_, {}};
    join.leader = leader.peer_id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      join.expiration_ms = expiration_ms_;
    }
    const std::string req = seal_join(join, *id_);
    conn->send(kMsgJoin, req, std::min(deadline, after(o.request_timeout)));
    const Frame r = conn->receive(std::min(deadline, after(o.request_timeout)), 4096);
    if (r.type != kMsgJoinReply) return std::nullopt;
    Reader rd(r.payload);
    const auto code = static_cast<JoinCode>(rd.u32());
    *suggested = rd.str(kMaxId);
    if (code != JoinCode::kAccepted) return std::nullopt;
    {
      std::lock_guard<std::mutex> lock(mu_);
      leader_ = leader.peer_id;
      disband_locked(leader.peer_id);  // our own followers go to our leader
    }
    struct Unfollow {
      Matchmaker* mm;
      ~Unfollow() {
        std::lock_guard<std::mutex> lock(mm->mu_);
        mm->leader_.clear();
      }
    } unfollow{this};
    const size_t max_members = std::min(std::max<size_t>(o.target_group_size, 2), kMaxMembers);
    const Frame outcome =
        conn->receive(std::min(deadline, steady_at(leader.expiration_ms) + o.request_timeout + std::chrono::milliseconds(1000)),
                      max_sealed_group_bytes(max_members) + 64);
    if (outcome.type == kMsgBegin) return begin_as_follower(leader, o, outcome.payload, max_members);
    if (outcome.type == kMsgDisband && outcome.payload.size() <= kMaxId) *suggested = outcome.payload;
    return std::nullopt;
  } catch (const NetError&) {
    return std::nullopt;
  }
}

std::optional<Group> Matchmaker::begin_as_follower(const Declaration& leader, const MatchmakingOptions& o,
                                                  const std::string& sealed, size_t max_members) {
  auto opened = open_group(sealed, LeaderView{leader.peer_id, leader.address, leader.bandwidth}, o.key, id_->peer_id(),
                           max_members);
  std::lock_guard<std::mutex> lock(mu_);
  if (!opened.group) {
    // A list that does not verify is a leader lying about its group (or a broken one): this
    // round goes on without it, and it is never followed again.
    ++forged_lists_;
    if (forgers_.size() < kMaxForgers) forgers_.insert(leader.peer_id);
    std::fprintf(stderr, "hivemind: the group list of leader %s for %s does not verify (%s): refused, looking for another group\n",
                 leader.peer_id.substr(0, 16).c_str(), o.key.c_str(), opened.why.c_str());
    return std::nullopt;
  }
  looking_ = false;
  opened.group->identity = id_;
  return opened.group;
}

uint64_t Matchmaker::forged_lists() const {
  std::lock_guard<std::mutex> lock(mu_);
  return forged_lists_;
}

bool Matchmaker::is_forger(const std::string& peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return forgers_.count(peer_id) > 0;
}

std::optional<Group> Matchmaker::find_group(const MatchmakingOptions& o, const std::function<size_t()>& expected,
                                            Deadline deadline, const std::function<bool()>& abandon) {
  const bool client = address_.empty();
  const auto ttl = std::max<std::chrono::milliseconds>(std::chrono::seconds(11), o.matchmaking_time + o.request_timeout);
  auto declare = [&] {
    int64_t exp;
    {
      std::lock_guard<std::mutex> lock(mu_);
      expiration_ms_ = unix_ms() + o.matchmaking_time.count();
      exp = expiration_ms_;
    }
    if (!client)
      dht_.store(o.key, "group", encode_declaration(Declaration{id_->peer_id(), address_, o.bandwidth, exp}), ttl,
                 std::min<std::chrono::milliseconds>(o.request_timeout, std::chrono::milliseconds(2000)));
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    PT_CHECK(!looking_, "find_group while another is running");
    PT_CHECK(!(client && o.auxiliary), "an auxiliary peer must accept streams (it has no address here)");
    if (stopping_) return std::nullopt;
    key_ = o.key;
    target_ = std::max<size_t>(o.target_group_size, 1);
    bandwidth_ = client ? 0.0 : o.bandwidth;
    auxiliary_ = o.auxiliary;
    leader_.clear();
    followers_.clear();
    looking_ = !client;  // a client accepts no followers
  }
  declare();
  std::set<std::string> tried;
  std::string next_leader;  // suggested by a refusal or a disbanding leader
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) {
        looking_ = false;
        return std::nullopt;
      }
      const size_t size = followers_.size() + 1;
      const bool past = unix_ms() >= expiration_ms_ || Clock::now() >= deadline;
      if (!client && size >= 2) {
        lock.unlock();
        const size_t want = expected ? expected() : 0;
        lock.lock();
        const size_t now_size = followers_.size() + 1;
        if (now_size >= target_ || (want > 0 && now_size >= want && now_size >= o.min_group_size) ||
            (past && now_size >= o.min_group_size))
          return begin_locked();
      }
      if (past) {
        disband_locked("");
        if (Clock::now() + o.matchmaking_time / 2 >= deadline) {
          looking_ = false;
          return std::nullopt;
        }
        lock.unlock();
        if (abandon && abandon()) {
          lock.lock();
          disband_locked("");  // anyone who joined in between
          looking_ = false;
          return std::nullopt;
        }
        declare();  // try again with a new expiration
        tried.clear();
        continue;
      }
    }
    // Look for an earlier leader.
    std::vector<Declaration> candidates;
    const int64_t now_ms = unix_ms();
    int64_t my_exp;
    {
      std::lock_guard<std::mutex> lock(mu_);
      my_exp = expiration_ms_;
    }
    for (const auto& r : dht_.fetch(o.key, std::min<std::chrono::milliseconds>(o.request_timeout, std::chrono::milliseconds(2000)))) {
      if (r.kind != "group") continue;
      auto d = decode_declaration(r.payload);
      if (!d) continue;
      d->peer_id = to_hex(r.owner);  // the signer, not anything the payload claims
      if (d->peer_id == id_->peer_id() || d->expiration_ms <= now_ms) continue;
      if (!client && !earlier(d->expiration_ms, d->peer_id, my_exp, id_->peer_id())) continue;
      if (tried.count(d->peer_id) && d->peer_id != next_leader) continue;
      if (is_banned(d->peer_id) || is_forger(d->peer_id)) continue;  // never follow a poisoner or a forger
      candidates.push_back(*d);
    }
    std::sort(candidates.begin(), candidates.end(), [](const Declaration& a, const Declaration& b) {
      return earlier(a.expiration_ms, a.peer_id, b.expiration_ms, b.peer_id);
    });
    auto pick = std::find_if(candidates.begin(), candidates.end(), [&](const auto& d) { return d.peer_id == next_leader; });
    if (pick == candidates.end()) pick = candidates.begin();
    if (pick != candidates.end()) {
      const Declaration leader = *pick;
      tried.insert(leader.peer_id);
      std::string suggested;
      if (auto g = try_join(leader, o, deadline, &suggested)) return g;
      next_leader = suggested;
      backoff = std::chrono::milliseconds(10);
      continue;
    }
    next_leader.clear();
    std::unique_lock<std::mutex> lock(mu_);
    const size_t before = followers_.size();
    cv_.wait_for(lock, backoff, [&] { return stopping_ || followers_.size() != before; });
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace polytrain::hivemind
