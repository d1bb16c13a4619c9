// No epoch or state taken on one peer's word (issue 38, item 2) and the parameter round's check
// (item 3): the vouching and throughput rules of progress.h, the donors' choice and the donor's
// refusal of an epoch it has not reached (state.h), and round_check.h. All in-process, seconds.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <string>
#include <vector>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/progress.h"
#include "polytrain/swarm/round_check.h"
#include "polytrain/swarm/state.h"
#include "polytrain/swarm/wire.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;

namespace {

hm::PeerProgress trainer(int64_t epoch, double sps, double now, const std::string& id) {
  hm::PeerProgress p{epoch, 8, sps, now, false};
  p.peer_id = id;
  return p;
}

}  // namespace

// The review's forger (a checkpoint at step 5000, its real throughput) against a swarm at epoch
// 5 with target 64 whose peers run at ~10 samples/s: once a peer has seen the swarm, 5000 is
// beyond what any throughput of the swarm allows, and the forger does not vote at all, even as
// the only other trainer (where vouching alone needs just 1 voice).
TEST(EpochRule, OneIdentityClaimingEpoch5000IsRefused) {
  const double t0 = 1000.0, now = t0 + 10.0;
  const hm::PeerProgress self = trainer(5, 10.0, now, "self");
  const hm::PeerProgress forger = trainer(5000, 10.0, now, "f0rger00");
  const hm::EpochBaseline seen{5, t0};
  // Without a baseline (a peer that has not seen the swarm yet), the one other trainer vouches.
  EXPECT_EQ(hm::aggregate_progress({forger}, self, 64, now).epoch, 5000);
  auto g = hm::aggregate_progress({forger}, self, 64, now, 0.05, 5.0, seen);
  EXPECT_EQ(g.epoch, 5);
  EXPECT_EQ(g.claimed_epoch, 5000);
  EXPECT_EQ(g.claimant, "f0rger00");
  // 20 samples/s for 10 s, twice over, is 400 samples: 6 epochs of 64, plus one.
  EXPECT_EQ(g.reachable, 5 + 1 + 6);
  EXPECT_GT(g.claimed_epoch, g.reachable);
  // An inflated throughput buys little: the forger's 1e12 samples/s counts 4x the median's.
  g = hm::aggregate_progress({trainer(5000, 1e12, now, "f0rger00"), trainer(5, 10.0, now, "h1")}, self, 64, now, 0.05,
                             5.0, seen);
  EXPECT_EQ(g.epoch, 5);
  EXPECT_EQ(g.reachable, 5 + 1 + static_cast<int64_t>(2.0 * (10 + 10 + 40) * 10.0 / 64));
  // Nor does vouching: with two honest others a lone forger is 1 of 3 (2 must vouch).
  EXPECT_EQ(hm::aggregate_progress({forger, trainer(5, 10, now, "h1"), trainer(5, 10, now, "h2")}, self, 64, now).epoch, 5);
}

TEST(EpochRule, SeveralAgreeingIdentitiesWithinThroughputAreAccepted) {
  const double t0 = 1000.0, now = t0 + 10.0;
  const hm::PeerProgress self = trainer(5, 10.0, now, "self");
  const hm::EpochBaseline seen{5, t0};
  // Two of three others at 9 (reachable: 5 + 1 + 2 x 40 x 10 / 64 = 18): adopted.
  const std::vector<hm::PeerProgress> others = {trainer(9, 10, now, "a"), trainer(9, 10, now, "b"),
                                                trainer(5, 10, now, "c")};
  auto g = hm::aggregate_progress(others, self, 64, now, 0.05, 5.0, seen);
  EXPECT_EQ(g.reachable, 18);
  EXPECT_EQ(g.epoch, 9);
  // The same two at 500: agreeing, but beyond the throughput: refused.
  auto far = others;
  far[0].epoch = far[1].epoch = 500;
  g = hm::aggregate_progress(far, self, 64, now, 0.05, 5.0, seen);
  EXPECT_EQ(g.epoch, 5);
  EXPECT_EQ(g.claimed_epoch, 500);
  // One epoch ahead is always reachable (the round ending as the baseline was taken).
  EXPECT_EQ(hm::reachable_epoch(seen, 0.0, 64, t0), 6);
  EXPECT_EQ(hm::reachable_epoch({}, 10.0, 64, now), std::numeric_limits<int64_t>::max());
}

TEST(EpochRule, AJumpWithinTheSwarmsThroughputIsAccepted) {
  // A peer stopped for 30 s (SIGSTOP, a slow disk) finds the swarm 12 epochs on: 3 peers at
  // 10 samples/s do 30 x 30 / 64 = 14 epochs in that time; the jump is within the bound.
  const double t0 = 1000.0, now = t0 + 30.0;
  const hm::PeerProgress self = trainer(5, 10.0, t0, "self");
  const std::vector<hm::PeerProgress> others = {trainer(17, 10, now, "a"), trainer(17, 10, now, "b")};
  const auto g = hm::aggregate_progress(others, self, 64, now, 0.05, 5.0, {5, t0});
  EXPECT_EQ(g.epoch, 17);
  // Honest peers of different speeds add up (the fast one counts 4x the median at most).
  EXPECT_DOUBLE_EQ(hm::robust_throughput({1, 1, 10}), 6.0);
  EXPECT_DOUBLE_EQ(hm::robust_throughput({0, 5, std::nan("")}), 5.0);
  EXPECT_DOUBLE_EQ(hm::robust_throughput({}), 0.0);
}

TEST(EpochRule, TheBaselineIsSetByTheFirstVoteAndFollowsTheVouchedEpoch) {
  hm::GlobalProgress g;
  g.epoch = 3;
  // No voter and nothing trained yet (a newcomer still starting): not set, so the swarm it finds
  // is taken as it is; a founder that has trained alone has seen its swarm.
  EXPECT_LT(hm::advance_baseline({}, g, 10.0, false).epoch, 0);
  EXPECT_EQ(hm::advance_baseline({}, g, 10.0, true).epoch, 3);
  g.vouchers = 1;
  auto b = hm::advance_baseline({}, g, 10.0, false);
  EXPECT_EQ(b.epoch, 3);
  EXPECT_DOUBLE_EQ(b.time, 10.0);
  EXPECT_DOUBLE_EQ(hm::advance_baseline(b, g, 20.0, true).time, 10.0) << "no move: the time it was seen stays";
  g.epoch = 4;
  b = hm::advance_baseline(b, g, 20.0, true);
  EXPECT_EQ(b.epoch, 4);
  EXPECT_DOUBLE_EQ(b.time, 20.0);
}

// A state agreed by several distinct donors beats a newer one claimed by one identity, whether
// that identity announces it once, under many records, or many identities give one address.
TEST(DonorChoice, TheDigestMostDistinctDonorsAgreeOnWins) {
  const auto honest = hm::digest32("honest"), forged = hm::digest32("forged");
  hm::DownloadOptions o;
  o.seed = 3;
  std::vector<hm::DonorInfo> all = {{"h1", "10.0.0.1:1", 7, 100, honest}, {"h2", "10.0.0.2:1", 7, 100, honest},
                                    {"f1", "10.0.0.9:1", 7, 100, forged}, {"f1", "10.0.0.9:2", 7, 100, forged},
                                    {"f1", "10.0.0.9:3", 7, 100, forged}};
  auto chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 2u);
  for (const auto& d : chosen) EXPECT_TRUE(d.digest == honest) << d.peer_id;
  // Three identities behind one address: one voice.
  for (int i = 2; i < 5; ++i) all[i].peer_id = "f" + std::to_string(i), all[i].address = "10.0.0.9:1";
  chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 2u);
  EXPECT_TRUE(chosen[0].digest == honest);
  // Three real ones (ids and addresses) are three voices: a Sybil majority wins (the threat model).
  for (int i = 2; i < 5; ++i) all[i].address = "10.0.0.9:" + std::to_string(i);
  chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 3u);
  EXPECT_TRUE(chosen[0].digest == forged);
  // One donor at a newer epoch than two that agree: the two win.
  all.resize(2);
  all.push_back({"f1", "10.0.0.9:1", 5000, 100, forged});
  chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 2u);
  EXPECT_EQ(chosen[0].epoch, 7);
}

// A request for an epoch the donor has not reached cannot be met: refused at once, and the
// donor takes no snapshot (the provider holds the lock of its step).
TEST(DonorRefusal, AnEpochBeyondTheDonorsOwnIsRefusedWithoutASnapshot) {
  hm::Router router;
  hm::Server server("127.0.0.1:0", router.handler());
  hm::StateDonor donor(nullptr, router, "run_state", server.address());
  std::atomic<int> calls{0};
  donor.set_provider([&] {
    ++calls;
    return hm::StateSnapshot{4, std::string(1000, 'x'), {}};
  });
  donor.announce(4);
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(hm::fetch_manifest(server.address(), 5 + i, hm::after(5s), &why));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_EQ(calls.load(), 0);
  EXPECT_NE(why.find("no state at epoch 24"), std::string::npos) << why;
  // Its own epoch is served (one snapshot), and again from that snapshot.
  ASSERT_TRUE(hm::fetch_manifest(server.address(), 4, hm::after(5s)));
  ASSERT_TRUE(hm::fetch_manifest(server.address(), 2, hm::after(5s)));
  EXPECT_EQ(calls.load(), 1);
  // Once it steps, the next epoch is served.
  donor.announce(5);
  EXPECT_FALSE(hm::fetch_manifest(server.address(), 6, hm::after(5s)));
  EXPECT_EQ(calls.load(), 1);
  server.stop();
}

// A swarm that steps faster than its progress records spread: the only donor's state is one
// epoch past the vouched epoch the loader read. Nothing loads, and the report says why (the
// epoch, the vouched one) and carries the donor's epoch, so the caller reads the vouched epoch
// again and asks again; with the newer vouched epoch the state loads.
TEST(DonorChoice, ADonorPastTheVouchedEpochIsReportedAsSuch) {
  hm::DhtOptions o;
  o.run_id = "ahead";
  o.listen = "127.0.0.1:0";
  std::array<uint8_t, 32> seed{};
  seed.fill(51);
  hm::DhtNode a(o, std::make_shared<hm::Identity>(hm::Identity::from_seed(seed)));
  o.initial_peers = {a.address()};
  seed.fill(52);
  hm::DhtNode b(o, std::make_shared<hm::Identity>(hm::Identity::from_seed(seed)));
  hm::Router router;
  hm::Server server("127.0.0.1:0", router.handler());
  hm::StateDonor donor(&a, router, "ahead_state", server.address());
  donor.set_provider([] { return hm::StateSnapshot{6, std::string(5000, 'y'), {}}; });
  donor.announce(6);
  hm::DownloadOptions d;
  d.timeout = 10s;
  d.min_epoch = 4;
  d.max_epoch = 5;
  hm::DownloadReport rep;
  std::optional<hm::StateSnapshot> got;
  // The announcement may take a moment to be readable from b.
  for (int i = 0; i < 20 && rep.newer_than_vouched < 0; ++i) {
    got = hm::load_state_from_peers(b, "ahead_state", d, &rep);
    if (rep.newer_than_vouched < 0) std::this_thread::sleep_for(200ms);
  }
  EXPECT_FALSE(got);
  EXPECT_EQ(rep.newer_than_vouched, 6);
  EXPECT_NE(rep.why_none.find("1 donor(s) at epoch 6 or later: beyond the swarm's vouched epoch 5"), std::string::npos) << rep.why_none;
  d.max_epoch = 6;
  got = hm::load_state_from_peers(b, "ahead_state", d, &rep);
  ASSERT_TRUE(got) << rep.why_none;
  EXPECT_EQ(got->epoch, 6);
  EXPECT_EQ(rep.newer_than_vouched, -1);
  server.stop();
}

// The parameter round's result is checked part by part against the member's own values: an
// honest average passes; a NaN or a huge (or flipped and scaled) part is failed, named by part,
// and the other parts are kept; optimizer statistics after the parameters are only checked for
// finiteness.
TEST(ParameterRoundCheck, FailsNonFiniteAndFarPartsKeepsTheRest) {
  const size_t n = 300, params = 200;
  std::vector<float> own(n), avg(n);
  for (size_t i = 0; i < n; ++i) own[i] = std::sin(0.1f * i) + 0.5f, avg[i] = own[i] * 1.01f;
  {
    hm::ParameterRoundCheck c({100, 100, 100}, params);
    c.add(0, avg.data(), own.data(), 150);  // in two runs, as tensors come
    c.add(150, avg.data() + 150, own.data() + 150, 150);
    EXPECT_TRUE(c.failed_parts().empty());
  }
  avg[20] = std::nanf("");
  for (size_t i = 100; i < 200; ++i) avg[i] = own[i] * 1e15f;
  for (size_t i = 200; i < 300; ++i) avg[i] = own[i] * 50.0f;  // statistics: far is allowed
  hm::ParameterRoundCheck c({100, 100, 100}, params);
  c.add(0, avg.data(), own.data(), n);
  EXPECT_EQ(c.failed_parts(), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(c.why(0), "not finite");
  EXPECT_NE(c.why(1).find("of their norm"), std::string::npos) << c.why(1);
  EXPECT_EQ(c.why(2), "");
  EXPECT_EQ(c.part_range(1), (std::pair<size_t, size_t>{100, 200}));
  // A flipped part (-1x) is 2 norms away; the average with an independent one ~0.7: kept.
  std::vector<float> flipped(own), other(own);
  for (size_t i = 0; i < params; ++i) flipped[i] = -own[i], other[i] = 0.5f * (own[i] + std::cos(0.37f * i));
  hm::ParameterRoundCheck f({params}, params), h({params}, params);
  f.add(0, flipped.data(), own.data(), params);
  h.add(0, other.data(), own.data(), params);
  EXPECT_EQ(f.failed_parts().size(), 1u);
  EXPECT_TRUE(h.failed_parts().empty()) << h.why(0);
  // Zero own values (fresh biases) may move a little, not a lot.
  std::vector<float> zero(10, 0.0f), small(10, 1e-4f), big(10, 1.0f);
  hm::ParameterRoundCheck zs({10}, 10), zb({10}, 10);
  zs.add(0, small.data(), zero.data(), 10);
  zb.add(0, big.data(), zero.data(), 10);
  EXPECT_TRUE(zs.failed_parts().empty());
  EXPECT_EQ(zb.failed_parts().size(), 1u);
}
