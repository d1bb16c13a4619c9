// Authenticated rounds: averaging streams bound to their sender's signed join, the leader's
// signed group list checked against the joins, and weights bounded by signed progress. Each
// attack is driven by an attack client in the test against in-process peers over loopback.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "helpers/free_port.h"
#include "helpers/own_process.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/shipped_config.h"
#include "helpers/swarm_helpers.h"
#include "helpers/temp_dir.h"
#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/group_auth.h"
#include "polytrain/swarm/matchmaking.h"
#include "polytrain/swarm/progress.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/wire.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;
using polytrain::testing::eventually;

namespace {

std::shared_ptr<const hm::Identity> seeded(uint8_t seed) {
  std::array<uint8_t, 32> bytes{};
  bytes.fill(seed);
  return std::make_shared<hm::Identity>(hm::Identity::from_seed(bytes));
}

// A swarm peer's DHT, averaging endpoint and matchmaker, wired as the backend wires them.
struct MatchPeer {
  std::shared_ptr<const hm::Identity> id;
  std::unique_ptr<hm::DhtNode> dht;
  hm::AveragingPeer avg;
  std::unique_ptr<hm::Matchmaker> mm;
  MatchPeer(const hm::DhtOptions& o, uint8_t seed) : id(seeded(seed)), avg(false) {
    dht = std::make_unique<hm::DhtNode>(o, id);
    mm = std::make_unique<hm::Matchmaker>(*dht, avg.router, id, avg.address());
  }
  ~MatchPeer() {
    mm->stop();
    if (avg.server) avg.server->stop();
  }
};

std::vector<std::unique_ptr<MatchPeer>> swarm(const std::string& run_id, int count, uint8_t seed) {
  hm::DhtOptions d;
  d.run_id = run_id;
  d.listen = "127.0.0.1:0";
  std::vector<std::unique_ptr<MatchPeer>> peers;
  for (int i = 0; i < count; ++i) {
    peers.push_back(std::make_unique<MatchPeer>(d, static_cast<uint8_t>(seed + i)));
    if (i == 0) d.initial_peers = {peers[0]->dht->address()};
  }
  return peers;
}

hm::MatchmakingOptions matchmaking(const std::string& key) {
  hm::MatchmakingOptions o;
  o.key = key;
  o.matchmaking_time = 2s;
  o.request_timeout = 1s;
  o.target_group_size = 8;
  return o;
}

// Every peer looks for a group of `expected`; the groups found (by peer index).
std::vector<std::optional<hm::Group>> find_groups(std::vector<std::unique_ptr<MatchPeer>>& peers,
                                                  const hm::MatchmakingOptions& o, size_t expected,
                                                  std::chrono::milliseconds within) {
  std::vector<std::optional<hm::Group>> got(peers.size());
  std::vector<std::thread> t;
  for (size_t i = 0; i < peers.size(); ++i)
    t.emplace_back([&, i] { got[i] = peers[i]->mm->find_group(o, [expected] { return expected; }, hm::after(within)); });
  for (auto& th : t) th.join();
  return got;
}

// The peer whose id is member `index` of `g`.
MatchPeer& member(std::vector<std::unique_ptr<MatchPeer>>& peers, const hm::Group& g, size_t index) {
  for (auto& p : peers)
    if (p->id->peer_id() == g.members[index].peer_id) return *p;
  throw std::runtime_error("not a member");
}

std::vector<float> filled(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = base + 0.001f * static_cast<float>(k % 977);
  return v;
}

hm::Join join_of(const hm::Identity& id, const std::string& address, const std::string& key, const std::string& leader) {
  hm::Join j;
  j.key = key;
  j.member = hm::Member{id.peer_id(), address, 1.0};
  j.expiration_ms = hm::unix_ms() + 5000;
  j.leader = leader;
  return j;
}

// A leader's list of itself and `followers`, each with its own signed join.
hm::Group listed(const hm::Identity& leader, const std::vector<const hm::Identity*>& followers, const std::string& key) {
  hm::Group g;
  g.group_id = "auth/" + key;
  g.members.push_back(hm::Member{leader.peer_id(), "127.0.0.1:7000", 1.0});
  for (size_t i = 0; i < followers.size(); ++i) {
    const std::string address = "127.0.0.1:" + std::to_string(7001 + i);
    hm::Member m{followers[i]->peer_id(), address, 1.0};
    m.join = hm::seal_join(join_of(*followers[i], address, key, leader.peer_id()), *followers[i]);
    g.members.push_back(m);
  }
  return g;
}

}  // namespace

// What a follower checks in a leader's list, one forgery at a time; each names why.
TEST(GroupList, ALeaderCannotInventMembersOrChangeTheirEntries) {
  const auto leader = seeded(1), a = seeded(2), b = seeded(3), stranger = seeded(4);
  const std::string key = "auth-list_grad_0";
  const hm::LeaderView view{leader->peer_id(), "127.0.0.1:7000", 1.0};
  auto open = [&](const hm::Group& g, const hm::Identity& signer = hm::Identity::generate()) {
    return hm::open_group(hm::seal_group(g, signer), view, key, a->peer_id(), 8);
  };
  const hm::Group honest = listed(*leader, {a.get(), b.get()}, key);
  const auto ok = hm::open_group(hm::seal_group(honest, *leader), view, key, a->peer_id(), 8);
  ASSERT_TRUE(ok.group) << ok.why;
  EXPECT_EQ(ok.group->self, 1u);
  EXPECT_EQ(ok.group->members[2].address, "127.0.0.1:7002");

  EXPECT_EQ(open(honest).why, "not signed by the leader");
  auto invented = honest;  // a member that never joined
  invented.members.push_back(hm::Member{stranger->peer_id(), "127.0.0.1:7009", 1.0});
  EXPECT_NE(hm::open_group(hm::seal_group(invented, *leader), view, key, a->peer_id(), 8).why.find("has no join"),
            std::string::npos);
  auto elsewhere = honest;  // a stranger's real join, but to another leader
  elsewhere.members.push_back(listed(*stranger, {stranger.get()}, key).members[1]);
  EXPECT_NE(hm::open_group(hm::seal_group(elsewhere, *leader), view, key, a->peer_id(), 8).why.find("another round or leader"),
            std::string::npos);
  auto moved = honest;  // b's streams sent to the leader's own address
  moved.members[2].address = "127.0.0.1:7000";
  EXPECT_NE(hm::open_group(hm::seal_group(moved, *leader), view, key, a->peer_id(), 8).why.find("differs from its signed join"),
            std::string::npos);
  auto heavier = honest;  // b made to reduce most of the vector
  heavier.members[2].bandwidth = 1000.0;
  EXPECT_NE(hm::open_group(hm::seal_group(heavier, *leader), view, key, a->peer_id(), 8).why.find("differs from its signed join"),
            std::string::npos);
  auto rewritten = honest;  // b's join bytes edited to match the moved address
  const auto at = rewritten.members[2].join.find("127.0.0.1:7002");
  ASSERT_NE(at, std::string::npos);
  rewritten.members[2].join.replace(at, 14, "127.0.0.1:7000");
  rewritten.members[2].address = "127.0.0.1:7000";
  EXPECT_NE(hm::open_group(hm::seal_group(rewritten, *leader), view, key, a->peer_id(), 8).why.find("has no join"),
            std::string::npos);
  auto self_moved = honest;  // the leader's own entry against its declaration
  self_moved.members[0].address = "127.0.0.1:7100";
  EXPECT_NE(hm::open_group(hm::seal_group(self_moved, *leader), view, key, a->peer_id(), 8).why.find("declaration"),
            std::string::npos);
  EXPECT_NE(hm::open_group(hm::seal_group(honest, *leader), view, "auth-list_grad_1", a->peer_id(), 8).why.find("another round"),
            std::string::npos);
  EXPECT_FALSE(hm::open_group(hm::seal_group(honest, *leader), view, key, a->peer_id(), 2).group);  // above target
}

namespace {

// The attack client: a stream to member 0's part claiming member `claimed`'s sender index, its
// hello signed by `signer` (null: unsigned), followed by a part of poison (1e3 everywhere).
// Returns the first frame the reducer answers (a refusal, or the result's first chunk).
hm::Frame steal_index(const hm::Group& g, size_t claimed, const hm::Identity* signer, size_t n,
                      const hm::AllReduceOptions& o) {
  const size_t len = hm::part_sizes(n, g)[0];
  std::string hello;
  hm::put_str(hello, g.group_id);
  hm::put_u32(hello, static_cast<uint32_t>(claimed));
  hm::put_u32(hello, 0);
  hm::put_u64(hello, len);
  hm::put_u32(hello, 0);  // no compression
  hm::put_f64(hello, 1.0);
  hm::put_u64(hello, o.chunk_elements);
  if (signer) hm::put_str(hello, hm::sign_hello(*signer, g.members[0].peer_id, hello));
  auto c = hm::Connection::connect(g.members[0].address, hm::after(2s));
  c->send(hm::kMsgAllReduceHello, hello, hm::after(2s));
  const std::vector<float> poison(o.chunk_elements, 1e3f);
  try {  // a reducer that refused may have closed the stream already
    for (size_t k = 0, lo = 0; lo < len; ++k, lo += o.chunk_elements) {
      std::string head;
      hm::put_u64(head, k);
      const size_t m = std::min(o.chunk_elements, len - lo);
      c->send(hm::kMsgChunk, head, {reinterpret_cast<const char*>(poison.data()), m * 4}, hm::after(2s));
    }
  } catch (const hm::NetError&) {
  }
  return c->receive(hm::after(10s), o.chunk_elements * 4 + 4096);
}

struct StolenRound {
  std::vector<std::vector<float>> v;  // by member index
  std::vector<hm::AllReduceReport> r;
  std::string answers;  // what the reducer answered the attack streams
};

// One round of the group in `got` (each peer's copy) under `suffix`; with `attack`, member 2
// first tries to take member 1's slot at member 0's part (signed with its own key, then
// unsigned) while member 0 waits for its senders. `authenticated` false: the same group with
// no identities (a group built by hand), for the contrast.
StolenRound stolen_round(std::vector<std::unique_ptr<MatchPeer>>& peers, const std::vector<std::optional<hm::Group>>& got,
                         const std::vector<std::vector<float>>& inputs, const std::string& suffix, bool attack,
                         bool authenticated, const hm::AllReduceOptions& o) {
  const hm::Group& g = *got[0];
  const size_t n = inputs[0].size();
  StolenRound out{inputs, std::vector<hm::AllReduceReport>(3), ""};
  auto copy_of = [&](size_t i) {  // member i's own copy of the group
    hm::Group gi = g;
    for (const auto& x : got)
      if (x->self == i) gi = *x;
    gi.group_id += suffix;
    if (!authenticated) gi.identity = nullptr;
    return gi;
  };
  auto run = [&](size_t i) { out.r[i] = member(peers, g, i).avg.averager.allreduce(copy_of(i), out.v[i].data(), n, 1.0, o); };
  std::thread reducer0([&] { run(0); });
  std::vector<std::thread> attackers;
  std::mutex answers_mu;
  if (attack) {
    EXPECT_TRUE(eventually([&] { return member(peers, g, 0).avg.averager.rounds() == 1; }, 5s));
    for (const hm::Identity* signer : {member(peers, g, 2).id.get(), static_cast<const hm::Identity*>(nullptr)})
      attackers.emplace_back([&, signer] {
        const auto answer = steal_index(copy_of(2), 1, signer, n, o);
        std::lock_guard<std::mutex> lock(answers_mu);
        out.answers += (answer.type == hm::kMsgRefuse ? answer.payload : "(taken)") + "\n";
      });
    std::this_thread::sleep_for(300ms);  // the attack streams reach member 0 before member 1's
  }
  std::thread t1([&] { run(1); }), t2([&] { run(2); });
  reducer0.join(), t1.join(), t2.join();
  for (auto& a : attackers) a.join();
  return out;
}

}  // namespace

// A member of a live, matchmade group opens streams to a reducer claiming an honest member's
// sender index (signed with its own key, then unsigned), before the honest member's stream
// arrives, to put its own values in that member's slot. Both are refused; the honest member's
// stream gets its slot and every member ends with the bits of the same round unattacked. The
// same attack on the group without its identities (as a group built by hand) takes the slot.
TEST(AuthenticatedRound, AStolenSenderIndexIsRefusedAndTheRoundEqualsTheUnattackedOne) {
  auto peers = swarm("auth-steal", 3, 30);
  const auto got = find_groups(peers, matchmaking("auth-steal_grad_0"), 3, 6s);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(got[i]) << "peer " << i << " found no group";
    ASSERT_EQ(got[i]->members.size(), 3u);
    ASSERT_TRUE(got[i]->identity) << "a matchmade group signs its hellos";
  }
  const size_t n = 30'000;
  hm::AllReduceOptions o;
  o.chunk_elements = 4096;
  o.next_chunk_timeout = 3s;
  o.allreduce_timeout = 8s;
  const std::vector<std::vector<float>> inputs = {filled(n, 1.0f), filled(n, 2.0f), filled(n, 4.0f)};
  const auto attacked = stolen_round(peers, got, inputs, "/attacked", true, true, o);
  const auto clean = stolen_round(peers, got, inputs, "/clean", false, true, o);
  EXPECT_EQ(attacked.answers,
            "hello not signed by the member whose index it claims\nhello not signed by the member whose index it claims\n");
  EXPECT_EQ(attacked.r[0].unsigned_hellos, 2u) << attacked.r[0].warning();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(attacked.r[i].excluded_senders.empty() && attacked.r[i].failed_reducers.empty())
        << "member " << i << ": " << attacked.r[i].warning();
    EXPECT_EQ(std::memcmp(attacked.v[i].data(), clean.v[i].data(), n * 4), 0) << "member " << i;
    EXPECT_NEAR(attacked.v[i][5], (inputs[0][5] + inputs[1][5] + inputs[2][5]) / 3.0f, 1e-5);
  }
  const auto unauthenticated = stolen_round(peers, got, inputs, "/by-hand", true, false, o);
  EXPECT_NE(unauthenticated.answers.find("(taken)"), std::string::npos) << unauthenticated.answers;
  EXPECT_GT(unauthenticated.v[0][5], 100.0f) << "the poison should have reached member 0's part";
}

namespace {

// A leader that lies about its group: it declares itself first under the round's key, accepts
// every join and answers each with a list it signs but forges (an invented member, a follower's
// address moved to its own, a follower's bandwidth raised), in turn.
struct ForgingLeader {
  std::shared_ptr<const hm::Identity> id = seeded(99);
  std::unique_ptr<hm::DhtNode> dht;
  hm::Router router;
  std::unique_ptr<hm::Server> server;
  std::atomic<int> served{0};

  ForgingLeader(const std::string& run_id, const std::string& bootstrap) {
    hm::DhtOptions d;
    d.run_id = run_id;
    d.listen = "127.0.0.1:0";
    d.initial_peers = {bootstrap};
    dht = std::make_unique<hm::DhtNode>(d, id);
    router.on(hm::kMsgJoin, [this](hm::Connection& c, const hm::Frame& f) { serve(c, f); });
    server = std::make_unique<hm::Server>("127.0.0.1:0", router.handler());
  }
  ~ForgingLeader() { server->stop(); }

  bool try_declare(const std::string& key, int64_t expiration_ms) {
    const hm::Declaration d{id->peer_id(), server->address(), 1.0, expiration_ms};
    return dht->store(key, "group", hm::encode_declaration(d), 20s, 2s);
  }
  void declare(const std::string& key, int64_t expiration_ms) { ASSERT_TRUE(try_declare(key, expiration_ms)); }

  void serve(hm::Connection& c, const hm::Frame& f) {
    const auto join = hm::open_join(f.payload);
    if (!join) return;
    std::string reply;
    hm::put_u32(reply, 0);  // ACCEPTED
    hm::put_str(reply, "");
    c.send(hm::kMsgJoinReply, reply, hm::after(1s));
    hm::Group g;
    g.group_id = "forged/" + std::to_string(served.load());
    g.members.push_back(hm::Member{id->peer_id(), server->address(), 1.0});
    hm::Member follower = join->member;
    follower.join = f.payload;
    switch (served++ % 3) {
      case 0: g.members.push_back(hm::Member{seeded(98)->peer_id(), server->address(), 1.0}); break;
      case 1: follower.address = server->address(); break;
      default: follower.bandwidth = 1000.0; break;
    }
    g.members.push_back(follower);
    c.send(hm::kMsgBegin, hm::seal_group(g, *id), hm::after(1s));
  }
};

}  // namespace

// Three honest peers and a forging leader that declared before them: each honest peer joins it
// first, refuses its forged list, never follows it again, and the three form their own group,
// whose round then averages as usual.
TEST(AuthenticatedRound, ForgedGroupListsAreRefusedAndTheHonestPeersGoOn) {
  auto peers = swarm("auth-forge", 3, 40);
  ForgingLeader evil("auth-forge", peers[0]->dht->address());
  const auto o = matchmaking("auth-forge_grad_0");
  evil.declare(o.key, hm::unix_ms() + 1500);  // before any honest peer's expiration
  const auto got = find_groups(peers, o, 3, 8s);
  EXPECT_EQ(evil.served.load(), 3) << "each honest peer joins the forger once";
  const size_t n = 10'000;
  std::vector<std::vector<float>> v = {filled(n, 1.0f), filled(n, 2.0f), filled(n, 3.0f)};
  std::vector<std::thread> t;
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(got[i]) << "peer " << i << " found no group after the forged list";
    EXPECT_EQ(peers[i]->mm->forged_lists(), 1u) << "peer " << i;
    ASSERT_EQ(got[i]->members.size(), 3u) << "peer " << i;
    for (const auto& m : got[i]->members) EXPECT_NE(m.peer_id, evil.id->peer_id()) << "peer " << i;
  }
  for (size_t i = 0; i < 3; ++i)
    t.emplace_back([&, i] { peers[i]->avg.averager.allreduce(*got[i], v[i].data(), n, 1.0, hm::AllReduceOptions{}); });
  for (auto& th : t) th.join();
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(v[i][7], (1.0f + 2.0f + 3.0f) / 3.0f + 0.007f, 1e-5) << "peer " << i;
}

TEST(SignedWeights, ClaimsAtTheEpochCappedAtFourTimesTheirMedianAndTheMedianForTheRest) {
  auto rec = [](const std::string& id, int64_t epoch, int64_t samples, int64_t in_flight) {
    hm::PeerProgress p;
    p.peer_id = id, p.epoch = epoch, p.samples_accumulated = samples, p.samples_in_flight = in_flight;
    return p;
  };
  const hm::SignedWeights w({rec("a", 3, 16, 0), rec("b", 3, 12, 4), rec("c", 3, 8, 0), rec("d", 3, 1000, 0),
                             rec("e", 2, 64, 0), rec("f", 3, 0, 0)},
                            3);
  EXPECT_EQ(w.bound("a"), 16.0);
  EXPECT_EQ(w.bound("b"), 16.0);
  EXPECT_EQ(w.bound("c"), 8.0);
  EXPECT_EQ(w.bound("d"), 64.0);  // 4 x the lower median (16)
  EXPECT_EQ(w.bound("e"), 16.0);  // a record of another epoch: the median
  EXPECT_EQ(w.bound("f"), 16.0);  // no samples claimed
  EXPECT_EQ(w.bound("nobody"), 16.0);
  EXPECT_TRUE(std::isinf(hm::SignedWeights({}, 3).bound("a")));
}

// Three peers publish signed progress (16, 16 and 8 samples); the third then sends its vector
// with a weight of 120 samples, within the round's own bound (twice a target of 64). Each
// reducer clamps it to the 8 its record signed: the result is the (16, 16, 8)-weighted mean,
// not the (16, 16, 120) one the attacker wanted, and the reports name it.
TEST(AuthenticatedRound, AWeightAboveTheSendersSignedProgressIsClampedToIt) {
  auto peers = swarm("auth-weight", 3, 50);
  const std::string key = "auth-weight_progress";
  std::vector<std::unique_ptr<hm::ProgressTracker>> trackers;
  const int64_t samples[] = {16, 16, 8};
  for (size_t i = 0; i < 3; ++i) {
    trackers.push_back(std::make_unique<hm::ProgressTracker>(*peers[i]->dht, hm::ProgressTracker::Options{key, 64, false, 20.0, 0.0}, 0));
    trackers[i]->report_local_step(samples[i], 0.5);
    ASSERT_TRUE(trackers[i]->publish_now());
  }
  for (size_t i = 0; i < 3; ++i)
    ASSERT_TRUE(eventually([&] { return trackers[i]->global(true).samples_accumulated == 40; }, 10s)) << "peer " << i;
  hm::Group g;
  g.group_id = "auth-weight/0";
  for (auto& p : peers) g.members.push_back(hm::Member{p->id->peer_id(), p->avg.address(), 1.0});
  const size_t n = 9'000;
  const float base[] = {1.0f, 3.0f, 100.0f};
  std::vector<std::vector<float>> v;
  for (float b : base) v.emplace_back(n, b);
  std::vector<hm::AllReduceReport> r(3);
  std::vector<std::thread> t;
  for (size_t i = 0; i < 3; ++i)
    t.emplace_back([&, i] {
      hm::AllReduceOptions o;
      o.max_weight = 128;
      o.sender_max_weight = trackers[i]->signed_weights(0).as_function();
      hm::Group gi = g;
      gi.self = i;
      gi.identity = peers[i]->id;
      r[i] = peers[i]->avg.averager.allreduce(gi, v[i].data(), n, i == 2 ? 120.0 : static_cast<double>(samples[i]), o);
    });
  for (auto& th : t) th.join();
  const double expected = (16 * 1.0 + 16 * 3.0 + 8 * 100.0) / 40.0;  // 21.6; unclamped 79.4
  for (size_t i = 0; i < 3; ++i) {
    for (size_t k = 0; k < n; k += 997) ASSERT_NEAR(v[i][k], expected, 1e-4) << "peer " << i << ", element " << k;
    EXPECT_EQ(r[i].clamped_senders, std::vector<std::string>{peers[2]->id->peer_id()}) << r[i].warning();
    EXPECT_NE(r[i].warning().find("weight cut to its signed progress"), std::string::npos) << r[i].warning();
  }
}

namespace {

const std::string kTrainBert = POLYTRAIN_BINARY_DIR "/train_bert";

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

// The forged list against training: two train_bert peers and the forging leader above, which
// declares itself first under every round's key for the whole run. Each honest peer joins it
// once, refuses its list, never follows it again, and the pair trains on: both reach their last
// step with the same bits, within 1e-5 of one process that trains the same samples (where an
// unattacked pair ends).
TEST(AuthenticatedRound, AForgingLeaderDoesNotStopTrainingOrChangeItsResult) {
  PT_SKIP_UNLESS(polytrain::testing::bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  constexpr int kSteps = 8;
  polytrain::testing::TempDir tmp("pt_auth_train");
  const std::filesystem::path dir = tmp.path;
  std::ofstream(dir / "config.json") << polytrain::testing::deterministic_bert_tiny(dir / "exp", 1).dump(2);
  auto base = [&](const std::string& name) {
    return kTrainBert + " --config '" + (dir / "config.json").string() + "' --experiment_name " + name +
           " --save_dir '" + (dir / name).string() + "' --max_steps " + std::to_string(kSteps) + " --save_interval " +
           std::to_string(kSteps);
  };
  const int port = polytrain::testing::free_port();
  const std::string first = "127.0.0.1:" + std::to_string(port);
  const std::string run_id = "auth-train-" + std::to_string(::getpid());
  const std::string common = " --env_type hivemind --train_batch_size 16 --train_micro_batch_size_per_gpu 16"
                             " --target_batch_size 32 --num_streams 2 --expected_peers 2 --run_id " + run_id +
                             " --matchmaking_time 10 --averaging_timeout 30";
  std::vector<std::unique_ptr<polytrain::testing::OwnProcess>> honest;
  for (int k = 0; k < 2; ++k) {
    const std::string name = "peer" + std::to_string(k);
    honest.push_back(std::make_unique<polytrain::testing::OwnProcess>(
        "OMP_NUM_THREADS=1 exec " + base(name) + common + " --stream_index " + std::to_string(k) +
            (k == 0 ? " --listen " + first : " --listen 127.0.0.1:0 --initial_peers " + first),
        POLYTRAIN_SOURCE_DIR, (dir / (name + ".log")).string()));
    if (k == 0) std::this_thread::sleep_for(300ms);
  }
  ForgingLeader evil(run_id, first);
  std::atomic<bool> stop{false};
  std::atomic<int> stored{0};
  std::thread declarer([&] {  // first under every round's key, all run long
    while (!stop) {
      // A store fails once the honest peers have ended (nobody left to hold it): not counted.
      for (int e = 0; e <= kSteps; ++e) stored += evil.try_declare(run_id + "_grad_" + std::to_string(e), hm::unix_ms() + 1500);
      std::this_thread::sleep_for(300ms);
    }
  });
  const bool done = polytrain::testing::wait_until(
      [&] { return !honest[0]->running() && !honest[1]->running(); }, 240);
  stop = true;
  declarer.join();
  for (auto& p : honest) {
    if (!done) p->signal(SIGKILL);
    EXPECT_EQ(p->wait(), 0) << p->output();
  }
  ASSERT_TRUE(done) << "the honest peers did not finish in 240 s";
  EXPECT_GT(stored.load(), 0) << "the forger never declared";
  EXPECT_EQ(evil.served.load(), 2) << "each honest peer joins the forger once";
  for (auto& p : honest)
    EXPECT_EQ(occurrences(p->output(), "does not verify"), 1u) << p->output();
  const auto w0 = polytrain::testing::saved_weights(dir, "peer0", kSteps);
  const auto w1 = polytrain::testing::saved_weights(dir, "peer1", kSteps);
  double between = 0, to_ref = 0;
  const auto ref = polytrain::testing::run_program(base("ref") + " --env_type pytorch --train_batch_size 32"
                                                                  " --train_micro_batch_size_per_gpu 16");
  ASSERT_EQ(ref.code, 0) << ref.out;
  const auto wr = polytrain::testing::saved_weights(dir, "ref", kSteps);
  for (const auto& [k, v] : w0) {
    between = std::max(between, (w1.at(k) - v).abs().max().item<double>());
    to_ref = std::max(to_ref, (wr.at(k) - v).abs().max().item<double>());
  }
  std::printf("[auth] forging leader served %d joins; honest peers apart by %.3g, from one process by %.3g\n",
              evil.served.load(), between, to_ref);
  EXPECT_EQ(between, 0.0);
  EXPECT_LE(to_ref, 1e-5);
}
