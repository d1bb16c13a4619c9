// Poisoning from inside an averaging group (issue 38): CenteredClip, the caps on bandwidth and
// weight, non-finite contributions, and bans after repeated offences; unit tests of the
// functions and short rounds of in-process members over loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "helpers/swarm_helpers.h"
#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/matchmaking.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/robust.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;

using polytrain::testing::group_of;

namespace {

using Peer = hm::AveragingPeer;

std::vector<float> random_vector(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double l2(const std::vector<float>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t k = 0; k < a.size(); ++k) s += (a[k] - b[k]) * (a[k] - b[k]);
  return std::sqrt(s);
}

// Honest gradients: a shared direction plus each member's noise (norm of the noise ~ sqrt(n) sd).
std::vector<std::vector<float>> honest(size_t count, size_t n, uint64_t seed) {
  const auto common = random_vector(n, seed);
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < count; ++i) {
    auto noise = random_vector(n, seed + 1 + i, 0.1f);
    for (size_t k = 0; k < n; ++k) noise[k] += common[k];
    out.push_back(std::move(noise));
  }
  return out;
}

std::vector<double> mean_of(const std::vector<std::vector<float>>& xs, size_t count) {
  std::vector<double> m(xs[0].size(), 0.0);
  for (size_t i = 0; i < count; ++i)
    for (size_t k = 0; k < m.size(); ++k) m[k] += xs[i][k] / static_cast<double>(count);
  return m;
}

std::vector<hm::Contribution> contributions(const std::vector<std::vector<float>>& xs) {
  std::vector<hm::Contribution> in;
  for (const auto& x : xs) in.push_back({1.0, x.data()});
  return in;
}


std::vector<hm::AllReduceReport> run_round(std::vector<std::unique_ptr<Peer>>& peers, const hm::Group& g,
                                           std::vector<std::vector<float>>& v, const hm::AllReduceOptions& o) {
  std::vector<hm::AllReduceReport> r(peers.size());
  std::vector<std::thread> t;
  for (size_t i = 0; i < peers.size(); ++i)
    t.emplace_back([&, i] {
      auto gi = g;
      gi.self = i;
      r[i] = peers[i]->averager.allreduce(gi, v[i].data(), v[i].size(), 1.0, o);
    });
  for (auto& th : t) th.join();
  return r;
}

}  // namespace

TEST(CenteredClip, WithoutOutliersAndALargeTauItIsTheWeightedMeanBitForBit) {
  const size_t n = 5'000;
  auto xs = honest(4, n, 7);
  std::vector<hm::Contribution> in = contributions(xs);
  const double w[] = {3, 1, 2, 5};
  for (size_t i = 0; i < 4; ++i) in[i].weight = w[i];
  std::vector<float> out(n);
  const auto r = hm::centered_clip(in, n, 1e9, 5, out.data());
  EXPECT_EQ(r.iterations, 1);
  for (double kept : r.kept) EXPECT_EQ(kept, 1.0);
  for (size_t k = 0; k < n; ++k) {
    const double acc = 3.0 * xs[0][k] + 1.0 * xs[1][k] + 2.0 * xs[2][k] + 5.0 * xs[3][k];
    ASSERT_EQ(out[k], static_cast<float>(acc / 11.0)) << "element " << k;
  }
}

TEST(CenteredClip, AScaledOrFlippedOutlierAmongFourMovesTheResultLittle) {
  const size_t n = 10'000;
  for (float factor : {-1.0f, 100.0f, -100.0f}) {
    auto xs = honest(4, n, 11);
    const auto clean = mean_of(xs, 3);  // the honest members' mean
    for (float& x : xs[3]) x *= factor;
    std::vector<float> out(n), plain(n);
    const auto r = hm::centered_clip(contributions(xs), n, 5.0, 10, out.data());
    for (size_t k = 0; k < n; ++k) plain[k] = (xs[0][k] + xs[1][k] + xs[2][k] + xs[3][k]) / 4.0f;
    // The honest spread is ~0.1 sqrt(n) = 10 per member; tau 5 bounds the outlier's pull to
    // about tau / 4 per iteration around the honest centre.
    const double robust = l2(out, clean), mean = l2(plain, clean);
    EXPECT_LT(robust, 10.0) << "factor " << factor;
    EXPECT_GT(mean, 5 * robust) << "factor " << factor << ": the mean should be pulled much further";
    EXPECT_LT(r.kept[3], 0.5) << "factor " << factor << ": the outlier is clipped by more than half";
    for (int i = 0; i < 3; ++i) EXPECT_GE(r.kept[i], 0.5) << "factor " << factor << ", honest member " << i;
  }
}

TEST(CenteredClip, RefusesNonsenseArguments) {
  std::vector<float> x(4, 1.0f), out(4);
  EXPECT_ANY_THROW(hm::centered_clip({}, 4, 1.0, 1, out.data()));
  EXPECT_ANY_THROW(hm::centered_clip({{1.0, x.data()}}, 4, 0.0, 1, out.data()));
  EXPECT_ANY_THROW(hm::centered_clip({{1.0, x.data()}}, 4, 1.0, 0, out.data()));
  EXPECT_ANY_THROW(hm::centered_clip({{0.0, x.data()}}, 4, 1.0, 1, out.data()));
  EXPECT_EQ(hm::parse_aggregation("mean"), hm::Aggregation::kMean);
  EXPECT_EQ(hm::parse_aggregation("centered_clip"), hm::Aggregation::kCenteredClip);
  EXPECT_THROW(hm::parse_aggregation("median"), polytrain::InputError);
}

TEST(Offences, TheThirdOffenceBansAndOnlyThatOneSaysSo) {
  hm::Offences o(3);
  EXPECT_FALSE(o.record("x"));
  EXPECT_FALSE(o.record("x"));
  EXPECT_FALSE(o.banned("x"));
  EXPECT_TRUE(o.record("x"));
  EXPECT_TRUE(o.banned("x"));
  EXPECT_FALSE(o.record("x"));  // banned already: said once
  EXPECT_FALSE(o.banned("y"));
  EXPECT_EQ(o.count("x"), 4);
}

// Declared bandwidths are clamped at kMaxDeclaredBandwidth where they are read, the same on
// every member; with every reducer claiming 1e300 the parts are still the even split (before,
// 3 x 1e300 summed to infinity).
TEST(Caps, HugeBandwidthsAreClampedInGroupListsDeclarationsAndParts) {
  hm::Group g;
  g.group_id = "g";
  g.members = {{"a", "h:1", 1e300}, {"b", "h:2", 1e300}, {"c", "h:3", 1e308}};
  EXPECT_EQ(hm::part_sizes(300, g), (std::vector<size_t>{100, 100, 100}));
  const auto decoded = hm::decode_group(hm::encode_group(g), "b");
  ASSERT_TRUE(decoded);
  for (const auto& m : decoded->members) EXPECT_EQ(m.bandwidth, hm::kMaxDeclaredBandwidth);
  hm::Declaration d;
  d.address = "h:1";
  d.bandwidth = 1e300;
  d.expiration_ms = 1;
  const auto dd = hm::decode_declaration(hm::encode_declaration(d));
  ASSERT_TRUE(dd);
  EXPECT_EQ(dd->bandwidth, hm::kMaxDeclaredBandwidth);
}

TEST(Caps, ConfigRefusesABandwidthBeyondTheCapAndUnknownAggregations) {
  auto parse = [](const std::string& hivemind) {
    const std::string text = R"({"train_micro_batch_size_per_gpu": 8, "trainer": {"env_type": "hivemind"},
      "hivemind": {"target_batch_size": 64, )" + hivemind + "}}";
    return polytrain::config_from_json(polytrain::parse_json_strict(text, "test.json"), "test.json", 1);
  };
  auto message = [&](const std::string& hivemind) {
    try {
      parse(hivemind);
    } catch (const polytrain::InputError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message(R"("bandwidth": 1e300)").find("hivemind.bandwidth"), std::string::npos) << message(R"("bandwidth": 1e300)");
  EXPECT_NE(message(R"("aggregation": "median")").find("hivemind.aggregation"), std::string::npos);
  EXPECT_NE(message(R"("centered_clip_tau": 0)").find("hivemind.centered_clip_tau"), std::string::npos);
  EXPECT_NE(message(R"("centered_clip_iterations": 0)").find("hivemind.centered_clip_iterations"), std::string::npos);
  const auto cfg = parse(R"("aggregation": "centered_clip", "centered_clip_tau": 2.5, "centered_clip_iterations": 3)");
  EXPECT_EQ(cfg.hivemind.aggregation, "centered_clip");
  EXPECT_EQ(cfg.hivemind.centered_clip_tau, 2.5);
  EXPECT_EQ(cfg.hivemind.centered_clip_iterations, 3);
  EXPECT_EQ(parse(R"("bandwidth": 4)").hivemind.aggregation, "mean");
}

// A per-sender bound (what its signed progress claimed) cuts a weight that the round's bound
// allows down to it: the contribution counts, with the weight the sender signed for.
TEST(Caps, AWeightAboveTheSendersOwnBoundIsClampedToIt) {
  const size_t n = 1'000;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 2; ++i) peers.push_back(std::make_unique<Peer>(false));
  auto g = group_of(peers, "own-bound");
  std::vector<std::vector<float>> v = {std::vector<float>(n, 1.0f), std::vector<float>(n, 3.0f)};
  hm::AllReduceOptions o;
  o.max_weight = 100;
  o.sender_max_weight = [](const std::string& id) { return id == "peer1" ? 8.0 : 100.0; };
  std::vector<hm::AllReduceReport> r(2);
  const double w[] = {8, 64};  // peer1 claimed 8 samples and sends 64
  std::thread t([&] {
    auto g1 = g;
    g1.self = 1;
    r[1] = peers[1]->averager.allreduce(g1, v[1].data(), n, w[1], o);
  });
  r[0] = peers[0]->averager.allreduce(g, v[0].data(), n, w[0], o);
  t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(r[i].rejected_senders.empty()) << r[i].warning();
    EXPECT_EQ(r[i].clamped_senders, std::vector<std::string>{"peer1"}) << r[i].warning();
    for (size_t k = 0; k < n; ++k) ASSERT_EQ(v[i][k], 2.0f) << "peer " << i;  // (8 x 1 + 8 x 3) / 16, not 64's 2.78
  }
}

// Four members over loopback, one sending its gradient x100: the mean is pulled ~25x the
// honest spread away; CenteredClip stays near the honest mean, names the member, and a third
// such round bans it. In the round after (with the mean), the others leave it out without
// waiting for it and keep the part it would reduce local.
TEST(RobustRound, CenteredClipResistsAScaledMemberAndBansItAfterThreeRounds) {
  const size_t n = 40'000;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(std::make_unique<Peer>(false));
  hm::AllReduceOptions o;
  o.chunk_elements = 8'192;
  o.next_chunk_timeout = 1500ms;  // a member that waited for the banned one would take this long
  o.allreduce_timeout = 3s;
  {  // the mean, for the contrast
    auto v = honest(4, n, 21);
    const auto clean = mean_of(v, 3);
    for (float& x : v[3]) x *= 100.0f;
    run_round(peers, group_of(peers, "mean"), v, o);
    EXPECT_GT(l2(v[0], clean), 200.0);
  }
  o.aggregation = hm::Aggregation::kCenteredClip;
  o.centered_clip_tau = 5.0;  // per part: each holds a quarter of the vector, honest spread ~10
  o.centered_clip_iterations = 10;
  for (int round = 0; round < 3; ++round) {
    auto v = honest(4, n, 30 + round);
    const auto clean = mean_of(v, 3);
    for (float& x : v[3]) x *= 100.0f;
    const auto r = run_round(peers, group_of(peers, "clip" + std::to_string(round)), v, o);
    for (int i = 0; i < 3; ++i) {
      EXPECT_LT(l2(v[i], clean), 10.0) << "round " << round << ", peer " << i;
      EXPECT_EQ(std::memcmp(v[i].data(), v[0].data(), n * 4), 0) << "round " << round << ", peer " << i;
      EXPECT_EQ(r[i].clipped_senders, std::vector<std::string>{"peer3"}) << r[i].warning();
      EXPECT_EQ(peers[i]->averager.offences().banned("peer3"), round == 2);
      if (round == 2) EXPECT_NE(r[i].warning().find("banned from later groups after repeated offences: peer3"),
                                std::string::npos) << r[i].warning();
    }
  }
  o.aggregation = hm::Aggregation::kMean;  // the ban holds whatever the aggregation
  auto v = honest(4, n, 40);
  const auto exact = mean_of(v, 3);
  const auto r = run_round(peers, group_of(peers, "after"), v, o);
  for (int i = 0; i < 3; ++i) {
    // Not waiting for the banned member (the banned one itself may wait for its deadline: its
    // hellos can arrive after the others' rounds are over).
    EXPECT_LT(r[i].seconds, 1.2) << "peer " << i;
    EXPECT_EQ(r[i].banned_members, std::vector<std::string>{"peer3"}) << r[i].warning();
    // The three honest members' parts are their mean; peer3's part stays each one's own.
    EXPECT_NEAR(r[i].local_fraction, 0.25, 0.01);
    const size_t own = hm::part_sizes(n, group_of(peers, "after"))[0];
    for (size_t k = 0; k < own; ++k) ASSERT_NEAR(v[i][k], exact[k], 1e-5) << "peer " << i;
  }
}

// With the mean (the default): a member whose vector holds a NaN is left out of every part,
// the others end with exactly their own mean, and its third such round bans it.
TEST(RobustRound, ANonFiniteMemberIsLeftOutNamedAndBannedOnItsThirdRound) {
  const size_t n = 30'001;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>(false));
  hm::AllReduceOptions o;
  o.chunk_elements = 8'192;
  for (int round = 0; round < 3; ++round) {
    const auto clean = honest(3, n, 50 + round);
    auto v = clean;
    const auto g = group_of(peers, "nan" + std::to_string(round));
    const auto sizes = hm::part_sizes(n, g);
    for (size_t k = 0, off = 0; k < 3; off += sizes[k], ++k) v[2][off + sizes[k] / 2] = std::nanf("");  // one per part
    const auto r = run_round(peers, g, v, o);
    for (int i = 0; i < 2; ++i) {
      for (size_t k = 0; k < n; ++k)
        ASSERT_EQ(v[i][k], static_cast<float>((1.0 * clean[0][k] + 1.0 * clean[1][k]) / 2.0))
            << "round " << round << ", peer " << i << ", element " << k;
      EXPECT_NE(r[i].warning().find("non-finite values or a weight out of bounds: peer2"), std::string::npos) << r[i].warning();
      EXPECT_EQ(peers[i]->averager.offences().count("peer2"), round + 1);
      EXPECT_EQ(r[i].newly_banned == std::vector<std::string>{"peer2"}, round == 2) << r[i].warning();
    }
    EXPECT_EQ(peers[2]->averager.offences().count("peer2"), 0) << "a peer does not count its own bad part";
  }
}

namespace {

// A swarm peer's matchmaking, wired as the backend wires it: its matchmaker asks its averager's
// offences whom to keep out.
struct MatchPeer {
  std::shared_ptr<const hm::Identity> id;
  std::unique_ptr<hm::DhtNode> dht;
  hm::AveragingPeer avg;
  std::unique_ptr<hm::Matchmaker> mm;
  MatchPeer(const hm::DhtOptions& o, uint8_t seed, bool client) : avg(client) {
    std::array<uint8_t, 32> bytes{};
    bytes.fill(seed);
    id = std::make_shared<hm::Identity>(hm::Identity::from_seed(bytes));
    dht = std::make_unique<hm::DhtNode>(o, id);
    mm = std::make_unique<hm::Matchmaker>(*dht, avg.router, id, avg.address());
    mm->set_banned([this](const std::string& peer) { return avg.averager.offences().banned(peer); });
  }
  ~MatchPeer() {
    mm->stop();
    if (avg.server) avg.server->stop();
  }
};

}  // namespace

// Two trainers that banned a third peer (a client: it can only join) form their group without
// it: the leader refuses its validly signed join with PROTOCOL_VIOLATION, and it ends with none.
TEST(RobustRound, APeerBannedForPoisoningIsRefusedByTheLeaderAndLeftWithoutAGroup) {
  hm::DhtOptions d;
  d.run_id = "robust-ban";
  d.listen = "127.0.0.1:0";
  std::vector<std::unique_ptr<MatchPeer>> peers;
  for (int i = 0; i < 3; ++i) {
    peers.push_back(std::make_unique<MatchPeer>(d, static_cast<uint8_t>(70 + i), i == 2));
    if (i == 0) d.initial_peers = {peers[0]->dht->address()};
  }
  const std::string evil = peers[2]->id->peer_id();
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 3; ++k) peers[i]->avg.averager.offences().record(evil);
  hm::MatchmakingOptions o;
  o.key = "robust-ban_grad_0";
  o.matchmaking_time = 2s;
  o.request_timeout = 1s;
  std::vector<std::optional<hm::Group>> got(3);
  std::vector<std::thread> t;
  for (size_t i = 0; i < 3; ++i)
    t.emplace_back([&, i] { got[i] = peers[i]->mm->find_group(o, [] { return size_t{2}; }, hm::after(3500ms)); });
  for (auto& th : t) th.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(got[i]) << "peer " << i << " found no group";
    EXPECT_EQ(got[i]->members.size(), 2u) << "peer " << i;
    for (const auto& m : got[i]->members) EXPECT_NE(m.peer_id, evil) << "peer " << i;
  }
  EXPECT_FALSE(got[2]) << "the banned peer got into a group";
  EXPECT_GE(peers[0]->mm->refused(hm::JoinCode::kProtocolViolation) +
                peers[1]->mm->refused(hm::JoinCode::kProtocolViolation), 1u);
}
