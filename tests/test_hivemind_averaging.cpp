// Butterfly all-reduce over loopback TCP (env_type hivemind): exact weighted averages, parts
// sized by bandwidth, compression, and what happens when a sender or a reducer fails; state
// download from several donors (stripes, checksummed chunks, failover).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "helpers/free_port.h"
#include "polytrain/common/error.h"
#include "helpers/swarm_helpers.h"
#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/compression.h"
#include "polytrain/swarm/state.h"
#include "polytrain/swarm/wire.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;

using polytrain::testing::group_of;

namespace {

using Peer = hm::AveragingPeer;

std::vector<float> random_vector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}


// Runs one round on every peer but those listed in `absent`, each on its own thread.
std::vector<hm::AllReduceReport> run_round(std::vector<std::unique_ptr<Peer>>& peers, const hm::Group& g,
                                           std::vector<std::vector<float>>& v, size_t n,
                                           const hm::AllReduceOptions& o, size_t count) {
  std::vector<hm::AllReduceReport> r(count);
  std::vector<std::thread> t;
  for (size_t i = 0; i < count; ++i)
    t.emplace_back([&, i] {
      auto gi = g;
      gi.self = i;
      r[i] = peers[i]->averager.allreduce(gi, v[i].data(), n, 1.0, o);
    });
  for (auto& th : t) th.join();
  return r;
}

}  // namespace

TEST(Compression, HalfConversionMatchesIeeeOnEdgeCases) {
  EXPECT_EQ(hm::float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(hm::float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(hm::float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(hm::float_to_half(1e6f), 0x7c00);
  EXPECT_EQ(hm::float_to_half(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(hm::float_to_half(1.0f + 1.0f / 2048), 0x3c00);  // a tie rounds to even
  EXPECT_EQ(hm::float_to_half(1.0f + 3.0f / 2048), 0x3c02);
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(hm::float_to_half(hm::half_to_float(static_cast<uint16_t>(h))), h);
}

TEST(Compression, EachCodecKeepsItsStatedErrorAndRefusesWrongSizes) {
  const auto x = random_vector(10'000, 1);
  for (auto c : {hm::Compression::kNone, hm::Compression::kFp16, hm::Compression::kScaledFp16, hm::Compression::kUint8,
                 hm::Compression::kInt4}) {
    std::string bytes;
    hm::compress(c, x.data(), x.size(), bytes);
    ASSERT_EQ(bytes.size(), hm::compressed_bytes(c, x.size()));
    std::vector<float> y(x.size());
    ASSERT_TRUE(hm::decompress(c, bytes, y.data(), y.size()));
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(double(x[i]) - y[i]));
    // random_vector's values lie in [-5, 5]: absmax <= 5 in every block.
    const double bound = c == hm::Compression::kNone    ? 0.0
                         : c == hm::Compression::kUint8 ? 5.0 / 254
                         : c == hm::Compression::kInt4  ? 5.0 / 14
                                                        : 5.0 / 2048;
    EXPECT_LE(worst, bound) << hm::compression_name(c);
    EXPECT_FALSE(hm::decompress(c, std::string_view(bytes).substr(1), y.data(), y.size())) << hm::compression_name(c);
  }
  EXPECT_THROW(hm::parse_compression("zstd"), polytrain::InputError);
}

// int4 by hand: the layout (scale, then two values a byte, low nibble first), the per-block
// scale, an odd count, and what a block of zeros or a non-finite value becomes.
TEST(Compression, Int4PacksTwoValuesAByteWithAScalePerBlockOf64) {
  EXPECT_EQ(hm::compressed_bytes(hm::Compression::kInt4, 64), 4u + 32u);
  EXPECT_EQ(hm::compressed_bytes(hm::Compression::kInt4, 65), 4u + 32u + 4u + 1u);
  EXPECT_EQ(hm::compressed_bytes(hm::Compression::kInt4, 1000), 15u * 36u + 4u + 20u);
  const std::vector<float> x{7.0f, -7.0f, 3.0f, 0.0f, -1.4f};
  std::string bytes;
  hm::compress(hm::Compression::kInt4, x.data(), x.size(), bytes);
  ASSERT_EQ(bytes.size(), 4u + 3u);
  float scale;
  std::memcpy(&scale, bytes.data(), 4);
  EXPECT_EQ(scale, 7.0f);
  EXPECT_EQ(static_cast<uint8_t>(bytes[4]), 15u | (1u << 4));  // 7 -> 15, -7 -> 1
  EXPECT_EQ(static_cast<uint8_t>(bytes[5]), 11u | (8u << 4));  // 3 -> 11, 0 -> 8
  EXPECT_EQ(static_cast<uint8_t>(bytes[6]), 7u);               // -1.4 -> -1 -> 7, high nibble unused
  std::vector<float> y(x.size());
  ASSERT_TRUE(hm::decompress(hm::Compression::kInt4, bytes, y.data(), y.size()));
  EXPECT_EQ(y, (std::vector<float>{7.0f, -7.0f, 3.0f, 0.0f, -1.0f}));
  const std::vector<float> bad{1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  bytes.clear();
  hm::compress(hm::Compression::kInt4, bad.data(), bad.size(), bytes);
  std::vector<float> z(bad.size(), 5.0f);
  ASSERT_TRUE(hm::decompress(hm::Compression::kInt4, bytes, z.data(), z.size()));
  EXPECT_EQ(z, (std::vector<float>{0.0f, 0.0f, 0.0f}));  // a non-finite block is sent as zeros
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(bytes.data(), &inf, 4);
  EXPECT_FALSE(hm::decompress(hm::Compression::kInt4, bytes, z.data(), z.size()));
}

TEST(Butterfly, PartsFollowBandwidthAndClientsReduceNothing) {
  hm::Group g;
  g.members = {{"a", "h:1", 1.0}, {"b", "", 5.0}, {"c", "h:2", 3.0}};
  const auto s = hm::part_sizes(1000, g);
  EXPECT_EQ(s, (std::vector<size_t>{250, 0, 750}));
  EXPECT_EQ(hm::part_sizes(7, g)[0] + hm::part_sizes(7, g)[2], 7u);
}

// An auxiliary member (hivemind's AUX mode, --assist_in_averaging) beside two trainers: it
// reduces the share its bandwidth gives it (2 of 4: half the vector), sends nothing and weighs
// nothing, so the trainers end with the same bits as without it, their exact weighted average;
// the auxiliary's own values (NaN in its part, 7 elsewhere) are never read, and only its part
// of its vector is written.
TEST(Butterfly, AnAuxiliaryMemberReducesItsShareAndAddsNothing) {
  const size_t n = 400'000;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>());
  hm::Group g = group_of(peers, "aux");
  g.members[2].bandwidth = 2.0;
  g.members[2].auxiliary = true;
  const auto sizes = hm::part_sizes(n, g);
  EXPECT_EQ(sizes[2], n / 2);
  std::vector<std::vector<float>> v = {random_vector(n, 1), random_vector(n, 2), std::vector<float>(n, 7.0f)};
  std::fill(v[2].begin() + static_cast<long>(sizes[0] + sizes[1]), v[2].end(), std::nanf(""));
  const auto a = v[0], b = v[1];
  const double w[3] = {1.0, 3.0, 1e6};  // the auxiliary's weight is ignored
  hm::AllReduceOptions o;
  o.chunk_elements = 50'000;
  std::vector<hm::AllReduceReport> r(3);
  std::vector<std::thread> t;
  for (size_t i = 0; i < 3; ++i)
    t.emplace_back([&, i] {
      auto gi = g;
      gi.self = i;
      r[i] = peers[i]->averager.allreduce(gi, v[i].data(), n, w[i], o);
    });
  for (auto& th : t) th.join();
  for (size_t k = 0; k < n; ++k) {
    const float want = static_cast<float>((double(a[k]) + 3.0 * b[k]) / 4.0);
    ASSERT_EQ(v[0][k], want) << k;
    ASSERT_EQ(v[1][k], want) << k;
    if (k < sizes[0] + sizes[1]) ASSERT_EQ(v[2][k], 7.0f) << k;
    else ASSERT_EQ(v[2][k], want) << k;
  }
  EXPECT_EQ(r[2].part_elements, n / 2);
  EXPECT_EQ(r[2].part_senders, 2u);
  EXPECT_DOUBLE_EQ(r[2].part_weight, 4.0);
  EXPECT_EQ(r[0].part_senders, 2u) << "a trainer's part: itself and the other trainer, not the auxiliary";
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(r[i].warning().empty()) << i << ": " << r[i].warning();
}

// A member declaring a huge bandwidth reduces at most kMaxBandwidthRatio x the median share.
TEST(Butterfly, AHugeDeclaredBandwidthIsCappedAtFourTimesTheMedian) {
  hm::Group g;
  g.members = {{"a", "h:1", 1.0}, {"b", "h:2", 1.0}, {"liar", "h:3", 1e300}};
  EXPECT_EQ(hm::part_sizes(600, g), (std::vector<size_t>{100, 100, 400}));
  g.members.push_back({"c", "h:4", 3.0});  // the lower median of {1, 1, 3, 1e300} is 1
  EXPECT_EQ(hm::part_sizes(900, g), (std::vector<size_t>{100, 100, 400, 300}));
}

// Poisoning from inside a group (a member that is honest code with hostile inputs): peer 1's
// vector holds NaNs and peer 2 claims 1e12 samples against a max_weight of 100. Every reducer
// leaves both out of its part (peer 1 and peer 2 their own contributions too) and names them;
// all four end with the same bits, the weighted average of peers 0 and 3 alone. Before, the NaN
// reached every member (each then skipped its step) and the 1e12 weight replaced the average.
TEST(Butterfly, NonFiniteAndOverweightContributionsAreLeftOutAndNamed) {
  const size_t n = 100'003;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(std::make_unique<Peer>(false));
  auto g = group_of(peers, "poisoned");
  std::vector<std::vector<float>> v;
  for (int i = 0; i < 4; ++i) v.push_back(random_vector(n, 40 + i));
  for (size_t k = 0; k < n; k += 997) v[1][k] = std::numeric_limits<float>::quiet_NaN();  // in every part
  v[1][n - 1] = std::numeric_limits<float>::infinity();
  const std::vector<double> w = {10, 20, 1e12, 30};
  hm::AllReduceOptions o;
  o.chunk_elements = 20'000;
  o.max_weight = 100;
  std::vector<hm::AllReduceReport> reports(4);
  std::vector<std::thread> t;
  for (size_t i = 0; i < 4; ++i)
    t.emplace_back([&, i] {
      auto gi = g;
      gi.self = i;
      reports[i] = peers[i]->averager.allreduce(gi, v[i].data(), n, w[i], o);
    });
  for (auto& th : t) th.join();
  double worst = 0;
  const auto a = random_vector(n, 40), d = random_vector(n, 43);
  for (size_t k = 0; k < n; ++k)
    worst = std::max(worst, std::isfinite(v[0][k]) ? std::fabs(v[0][k] - (10.0 * a[k] + 30.0 * d[k]) / 40.0)
                                                   : std::numeric_limits<double>::infinity());
  EXPECT_LE(worst, 1e-6);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(std::memcmp(v[i].data(), v[0].data(), n * 4), 0) << "peer " << i << " differs from peer 0";
    std::set<std::string> named(reports[i].rejected_senders.begin(), reports[i].rejected_senders.end());
    EXPECT_EQ(named, (std::set<std::string>{"peer1", "peer2"})) << "peer " << i << ": " << reports[i].warning();
    EXPECT_NE(reports[i].warning().find("non-finite"), std::string::npos) << reports[i].warning();
  }
}

TEST(Butterfly, FourPeersEndWithTheSameBitsTheExactWeightedAverage) {
  const size_t n = 1'000'003;  // not a multiple of anything
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(std::make_unique<Peer>(i == 3));  // peer 3: client mode
  auto g = group_of(peers, "round-1");
  g.members[1].bandwidth = 2.0;
  std::vector<std::vector<float>> v;
  const std::vector<double> w = {16, 32, 0, 16};
  for (int i = 0; i < 4; ++i) v.push_back(random_vector(n, 10 + i));
  std::vector<double> expect(n);
  for (size_t k = 0; k < n; ++k) {
    double s = 0;
    for (int i = 0; i < 4; ++i) s += w[i] * v[i][k];
    expect[k] = s / 64.0;
  }
  hm::AllReduceOptions o;
  o.chunk_elements = 100'000;
  for (int round = 0; round < 3; ++round) {  // rounds reuse the peers; nothing is left behind
    auto vv = v;
    std::vector<hm::AllReduceReport> reports(4);
    std::vector<std::thread> t;
    for (size_t i = 0; i < 4; ++i) {
      t.emplace_back([&, i] {
        auto gi = g;
        gi.group_id = "round-" + std::to_string(round);
        gi.self = i;
        reports[i] = peers[i]->averager.allreduce(gi, vv[i].data(), n, w[i], o);
      });
    }
    for (auto& th : t) th.join();
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(reports[i].warning(), "") << i;
      EXPECT_EQ(std::memcmp(vv[i].data(), vv[0].data(), n * 4), 0) << "peer " << i << " differs from peer 0";
      EXPECT_EQ(peers[i]->averager.rounds(), 0u);
    }
    double worst = 0;
    for (size_t k = 0; k < n; ++k) worst = std::max(worst, std::fabs(vv[0][k] - expect[k]));
    EXPECT_LE(worst, 1e-6);
  }
  for (auto& p : peers)
    if (p->server) EXPECT_TRUE([&] {
        for (int i = 0; i < 100 && p->server->live() > 0; ++i) std::this_thread::sleep_for(10ms);
        return p->server->live() == 0;
      }());
}

TEST(Butterfly, CompressedRoundsLandNearTheAverage) {
  const size_t n = 200'000;
  for (auto c : {hm::Compression::kFp16, hm::Compression::kScaledFp16, hm::Compression::kUint8, hm::Compression::kInt4}) {
    std::vector<std::unique_ptr<Peer>> peers;
    for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>());
    auto g = group_of(peers, std::string("c-") + hm::compression_name(c));
    std::vector<std::vector<float>> v;
    for (int i = 0; i < 3; ++i) v.push_back(random_vector(n, 20 + i));
    auto vv = v;
    hm::AllReduceOptions o;
    o.compression = c;
    run_round(peers, g, vv, n, o, 3);
    double worst = 0;
    for (size_t k = 0; k < n; ++k) {
      const double avg = (double(v[0][k]) + v[1][k] + v[2][k]) / 3;
      for (int i = 0; i < 3; ++i) worst = std::max(worst, std::fabs(vv[i][k] - avg));
    }
    // int4: each value in [-5, 5] is off by at most 5 / 14 on its way to the reducer, and the
    // result's way back adds its own rounding.
    const double bound = c == hm::Compression::kInt4 ? 0.75 : c == hm::Compression::kUint8 ? 0.05 : 0.01;
    EXPECT_LE(worst, bound) << hm::compression_name(c);
    std::printf("[butterfly] %s: worst %.4f (bound %.3f)\n", hm::compression_name(c), worst, bound);
  }
}

TEST(Butterfly, AMemberThatNeverComesIsExcludedAndItsPartStaysLocal) {
  const size_t n = 300'000;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>());
  auto g = group_of(peers, "absent");
  // Member 2 is in the group but never runs the round: its server is gone.
  const std::string gone = peers[2]->address();
  peers[2]->server->stop();
  std::vector<std::vector<float>> v = {random_vector(n, 1), random_vector(n, 2)};
  auto vv = v;
  hm::AllReduceOptions o;
  o.next_chunk_timeout = 500ms;
  o.allreduce_timeout = 5s;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_round(peers, g, vv, n, o, 2);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(secs, 0.5 + 1.0) << "first contact timeout + 1 s";
  const auto sizes = hm::part_sizes(n, g);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(r[i].local_fraction, double(sizes[2]) / n, 1e-9);
    EXPECT_NE(r[i].warning().find("% of the vector kept its local values"), std::string::npos) << r[i].warning();
    ASSERT_EQ(r[i].excluded_senders.size(), 1u);
  }
  // Parts 0 and 1: the exact average of the two survivors; part 2: untouched.
  size_t off = 0;
  for (size_t j = 0; j < 3; ++j) {
    for (size_t k = off; k < off + sizes[j]; ++k)
      for (size_t i = 0; i < 2; ++i) {
        const float want = j == 2 ? v[i][k] : static_cast<float>((double(v[0][k]) + v[1][k]) / 2);
        ASSERT_EQ(vv[i][k], want) << "part " << j << " element " << k;
      }
    off += sizes[j];
  }
}

TEST(Butterfly, ASenderKilledMidStreamIsExcludedAndTheOthersFinishInTime) {
  // Four peers, one of them a real process that sends its hello and one chunk to every
  // reducer, then is SIGKILLed.
  const size_t n = 2'000'000;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>());
  hm::Group g = group_of(peers, "killed");
  g.members.push_back({"victim", "127.0.0.1:9", 1.0});  // its own part: nobody listens there
  hm::AllReduceOptions o;
  o.chunk_elements = 50'000;
  o.next_chunk_timeout = 1000ms;
  o.allreduce_timeout = 20s;
  fflush(stdout), fflush(stderr);
  const pid_t victim = fork();
  ASSERT_GE(victim, 0);
  if (victim == 0) {
    const auto sizes = hm::part_sizes(n, g);
    std::vector<std::unique_ptr<hm::Connection>> conns;
    for (size_t j = 0; j < 3; ++j) {
      try {
        auto c = hm::Connection::connect(g.members[j].address, hm::after(5s));
        std::string hello;
        hm::put_str(hello, g.group_id);
        hm::put_u32(hello, 3);
        hm::put_u32(hello, static_cast<uint32_t>(j));
        hm::put_u64(hello, sizes[j]);
        hm::put_u32(hello, 0);
        hm::put_f64(hello, 1.0);
        hm::put_u64(hello, o.chunk_elements);
        c->send(hm::kMsgAllReduceHello, hello, hm::after(5s));
        std::string chunk;
        hm::put_u64(chunk, 0);
        std::vector<float> zeros(o.chunk_elements, 1000.0f);
        hm::compress(hm::Compression::kNone, zeros.data(), zeros.size(), chunk);
        c->send(hm::kMsgChunk, chunk, hm::after(5s));
        conns.push_back(std::move(c));
      } catch (...) {
        _exit(3);
      }
    }
    std::this_thread::sleep_for(100ms);
    raise(SIGKILL);
  }
  std::vector<std::vector<float>> v = {random_vector(n, 1), random_vector(n, 2), random_vector(n, 3)};
  auto vv = v;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_round(peers, g, vv, n, o, 3);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int status = 0;
  ASSERT_EQ(waitpid(victim, &status, 0), victim);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the victim did not reach its kill";
  EXPECT_LE(secs, 1.0 + 1.0 + 1.0) << "next_chunk + reducer timeouts + 1 s";
  const auto sizes = hm::part_sizes(n, g);
  size_t off = 0;
  for (size_t j = 0; j < 4; ++j) {
    for (size_t k = off; k < off + sizes[j]; ++k)
      for (size_t i = 0; i < 3; ++i) {
        const float want = j == 3 ? v[i][k] : static_cast<float>((double(v[0][k]) + v[1][k] + v[2][k]) / 3);
        ASSERT_EQ(vv[i][k], want) << "peer " << i << " part " << j << " element " << k;
      }
    off += sizes[j];
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(r[i].excluded_senders, std::vector<std::string>{"victim"}) << i;
}

// A reducer that takes the whole part, answers two result chunks and breaks its stream in the
// middle of the third: those two chunks hold its answer, every other element of its part (the
// broken chunk's included: a chunk enters the vector only whole) keeps its local value, and
// the report's local fraction counts exactly those.
TEST(Butterfly, AReducerThatBreaksMidResultLeavesTheRestOfItsPartLocalAndSaysHowMuch) {
  const size_t n = 400'000, chunk = 50'000;
  std::vector<std::unique_ptr<Peer>> peers;
  peers.push_back(std::make_unique<Peer>());
  // The fake reducer speaks the frames by hand on a plain socket, to stop in mid-frame.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof addr;
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &alen), 0);
  std::thread fake([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    auto read_all = [&](void* p, size_t len) {
      for (size_t got = 0; got < len;) {
        const ssize_t k = ::read(fd, static_cast<char*>(p) + got, len - got);
        if (k <= 0) return false;
        got += static_cast<size_t>(k);
      }
      return true;
    };
    auto write_all = [&](const std::string& b) { return ::write(fd, b.data(), b.size()) == static_cast<ssize_t>(b.size()); };
    auto frame = [](uint8_t type, uint64_t k, const std::vector<float>& body, size_t body_bytes) {
      std::string f;
      const uint32_t len = static_cast<uint32_t>(1 + 8 + body.size() * 4);
      f.append(reinterpret_cast<const char*>(&len), 4);
      f.push_back(static_cast<char>(type));
      hm::put_u64(f, k);
      f.append(reinterpret_cast<const char*>(body.data()), body_bytes);
      return f;
    };
    // The hello and every chunk of its part (the hello's length field says how many).
    uint32_t len = 0;
    uint8_t type = 0;
    std::string payload;
    bool ok = read_all(&len, 4) && read_all(&type, 1);
    payload.resize(ok ? len - 1 : 0);
    ok = ok && read_all(payload.data(), payload.size());
    uint64_t part = 0;
    if (ok) {
      hm::Reader rd(payload);
      rd.str(256);
      rd.u32();
      rd.u32();
      part = rd.u64();
    }
    for (uint64_t k = 0; ok && k * chunk < part; ++k) {
      ok = read_all(&len, 4) && read_all(&type, 1);
      payload.resize(ok ? len - 1 : 0);
      ok = ok && read_all(payload.data(), payload.size());
    }
    const std::vector<float> answer(chunk, 7.0f);
    if (ok) ok = write_all(frame(hm::kMsgResult, 0, answer, chunk * 4)) && write_all(frame(hm::kMsgResult, 1, answer, chunk * 4));
    if (ok) write_all(frame(hm::kMsgResult, 2, answer, 1000));  // a quarter of a kilobyte of chunk 2, then gone
    ::close(fd);
  });
  struct Join {
    std::thread& t;
    int fd;
    ~Join() {
      ::shutdown(fd, SHUT_RDWR);
      t.join();
      ::close(fd);
    }
  } join_fake{fake, listener};
  hm::Group g;
  g.group_id = "broken-result";
  g.members = {{"peer0", peers[0]->address(), 1.0}, {"fake", "127.0.0.1:" + std::to_string(ntohs(addr.sin_port)), 1.0}};
  const auto v = random_vector(n, 5);
  auto vv = v;
  hm::AllReduceOptions o;
  o.chunk_elements = chunk;
  o.next_chunk_timeout = 500ms;
  o.allreduce_timeout = 10s;
  const auto r = peers[0]->averager.allreduce(g, vv.data(), n, 1.0, o);
  const auto sizes = hm::part_sizes(n, g);
  ASSERT_EQ(r.failed_reducers, std::vector<std::string>{"fake"});
  EXPECT_NEAR(r.local_fraction, double(sizes[1] - 2 * chunk) / n, 1e-12);
  EXPECT_NE(r.warning().find("kept its local values"), std::string::npos) << r.warning();
  for (size_t k = sizes[0]; k < n; ++k)
    ASSERT_EQ(vv[k], k < sizes[0] + 2 * chunk ? 7.0f : v[k]) << "element " << k;
  for (size_t k = 0; k < sizes[0]; ++k) ASSERT_EQ(vv[k], v[k]) << "own part, its sender never came: " << k;
}

// The dial-back service: an address on the requester's IP is dialled (reachable: yes; nothing
// listening: no), an address on any other IP is not dialled at all (no answer), and a helper
// that is not there is no answer either.
TEST(Wire, DialBackAnswersForTheRequestersOwnAddressesOnly) {
  hm::Router router;
  hm::serve_dial_back(router);
  hm::Server helper("127.0.0.1:0", router.handler());
  hm::Server listening("127.0.0.1:0", [](hm::Connection&) {});
  const std::string closed = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  EXPECT_EQ(hm::ask_dial_back(helper.address(), listening.address(), hm::after(3s)), std::optional<bool>(true));
  EXPECT_EQ(hm::ask_dial_back(helper.address(), closed, hm::after(3s)), std::optional<bool>(false));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(hm::ask_dial_back(helper.address(), "192.0.2.1:80", hm::after(3s)), std::nullopt);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5) << "it dialled a third party";
  EXPECT_EQ(hm::ask_dial_back(closed, listening.address(), hm::after(1s)), std::nullopt);
}

TEST(Wire, FramesLargerThanTheReaderAllowsAndSilentPeersEndWithinTheDeadline) {
  std::atomic<int> outcome{0};
  hm::Server server("127.0.0.1:0", [&](hm::Connection& c) {
    try {
      c.receive(hm::after(300ms), 16);
    } catch (const hm::NetError& e) {
      outcome = e.kind == hm::NetError::Kind::kProtocol ? 1 : 2;
    }
  });
  {
    auto c = hm::Connection::connect(server.address(), hm::after(2s));
    c->send(1, std::string(100, 'x'), hm::after(2s));
    for (int i = 0; i < 100 && outcome == 0; ++i) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(outcome.load(), 1);
  }
  outcome = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto c = hm::Connection::connect(server.address(), hm::after(2s));  // says nothing
  for (int i = 0; i < 200 && outcome == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(outcome.load(), 2);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.3);
  const auto t1 = std::chrono::steady_clock::now();
  server.stop();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 1.0);
  EXPECT_THROW(hm::Connection::connect("127.0.0.1:9", hm::after(1s)), hm::NetError);
}

TEST(Wire, ReceiveIntoPlacesMatchingFramesAndReturnsOthersWhole) {
  // The sender: a matching frame, a frame of another type (a refusal), a matching type of the
  // wrong length, then one larger than the reader accepts for a non-matching frame.
  hm::Server server("127.0.0.1:0", [&](hm::Connection& c) {
    std::string head(8, '\0');
    head[0] = 7;
    const std::vector<float> body = {1.5f, -2.25f, 3.0f};
    c.send(11, head, {reinterpret_cast<const char*>(body.data()), body.size() * 4}, hm::after(2s));
    c.send(13, "no round here", hm::after(2s));
    c.send(11, std::string(8 + 8, 'y'), hm::after(2s));
    c.send(13, std::string(5000, 'z'), hm::after(2s));
    c.receive(hm::after(2s), 16);  // holds the stream open until the reader is done
  });
  auto c = hm::Connection::connect(server.address(), hm::after(2s));
  uint64_t index = 0;
  float values[3] = {0, 0, 0};
  hm::Frame other;
  ASSERT_TRUE(c->receive_into(hm::after(2s), 11, &index, 8, values, sizeof values, other, 4096));
  EXPECT_EQ(index, 7u);
  EXPECT_EQ(values[0], 1.5f);
  EXPECT_EQ(values[1], -2.25f);
  EXPECT_EQ(values[2], 3.0f);
  EXPECT_FALSE(c->receive_into(hm::after(2s), 11, &index, 8, values, sizeof values, other, 4096));
  EXPECT_EQ(other.type, 13);
  EXPECT_EQ(other.payload, "no round here");
  EXPECT_FALSE(c->receive_into(hm::after(2s), 11, &index, 8, values, sizeof values, other, 4096));
  EXPECT_EQ(other.type, 11);
  EXPECT_EQ(other.payload.size(), 16u);
  EXPECT_EQ(values[0], 1.5f);  // a frame that does not match leaves the caller's memory alone
  try {
    c->receive_into(hm::after(2s), 11, &index, 8, values, sizeof values, other, 4096);
    ADD_FAILURE() << "a 5000-byte frame was accepted with at most 4096 allowed";
  } catch (const hm::NetError& e) {
    EXPECT_EQ(e.kind, hm::NetError::Kind::kProtocol);
  }
  c->abort();
}

namespace {

// A donor peer without a DHT: its server, router and donor.
struct Donor {
  hm::Router router;
  std::unique_ptr<hm::Server> server;
  std::unique_ptr<hm::StateDonor> donor;
  Donor(const std::string& id, int64_t epoch, const std::string& state) {
    server = std::make_unique<hm::Server>("127.0.0.1:0", router.handler());
    donor = std::make_unique<hm::StateDonor>(nullptr, router, "run_state", server->address());
    donor->publish(epoch, state);
    info = donor->info();
    info.peer_id = id;
  }
  // The server's streams call into the donor: stop them (joined) before the donor goes.
  ~Donor() { server->stop(); }
  hm::DonorInfo info;
};

std::string random_state(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&s[i], &v, 8);
  }
  return s;
}

hm::DownloadOptions small_pieces() {
  hm::DownloadOptions o;
  o.piece_bytes = 512 << 10;
  o.chunk_bytes = 128 << 10;
  o.timeout = 20s;
  o.next_chunk_timeout = 2s;
  o.seed = 7;
  return o;
}

}  // namespace

TEST(StateDownload, APeerStatePacksItsPartsAndRefusesTruncatedOrForeignBytes) {
  hm::PeerState s;
  s.epoch = 41;
  s.model = std::string(1000, 'm') + std::string(1, '\0');
  s.optimizer = "adam";
  s.config = "{}";
  const std::string b = hm::pack_peer_state(s);
  const auto back = hm::unpack_peer_state(b);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->epoch, 41);
  EXPECT_EQ(back->model, s.model);
  EXPECT_EQ(back->optimizer, "adam");
  EXPECT_EQ(back->config, "{}");
  for (size_t cut = 0; cut < b.size(); cut += 7) EXPECT_FALSE(hm::unpack_peer_state(b.substr(0, cut))) << cut;
  EXPECT_FALSE(hm::unpack_peer_state(b + "x"));
  EXPECT_FALSE(hm::unpack_peer_state("PK\3\4 a zip file, as torch::save writes"));
  std::string huge = b;  // a length field claiming more than there is
  huge[huge.find('m') - 1] = '\x7f';
  EXPECT_FALSE(hm::unpack_peer_state(huge));
}

TEST(StateDownload, StripesAcrossDonorsAndFinishesWhenOneDiesAndOneLies) {
  const std::string state = random_state(24 << 20, 1);
  std::vector<std::unique_ptr<Donor>> donors;
  for (int i = 0; i < 4; ++i) donors.push_back(std::make_unique<Donor>("donor" + std::to_string(i), 5, state));
  donors[1]->donor->corrupt_after(1 << 20);  // sends a bad chunk after 1 MB
  // Streams to donors 1, 2 and 0 at once; donor 3 stands by until one of them fails.
  std::vector<hm::DonorInfo> infos = {donors[1]->info, donors[2]->info, donors[0]->info, donors[3]->info};
  // donor2 dies once it served 3 MB: every stream it serves drops there (a hook in the donor,
  // not a thread stopping its server, which under load came too late: donor2 had served its
  // whole share and nothing failed).
  donors[2]->donor->die_after(3u << 20);
  auto o = small_pieces();
  o.max_donors = 3;
  hm::DownloadReport rep;
  const auto got = hm::download_state(infos, o, &rep);
  ASSERT_TRUE(got.has_value()) << rep.why_none;
  EXPECT_EQ(got->epoch, 5);
  EXPECT_TRUE(got->bytes == state);
  EXPECT_EQ(rep.bytes, state.size());
  ASSERT_EQ(rep.donors_failed.size(), 2u);
  std::string failed = rep.donors_failed[0] + "\n" + rep.donors_failed[1];
  EXPECT_NE(failed.find("checksum mismatch"), std::string::npos) << failed;
  EXPECT_NE(failed.find("donor1"), std::string::npos) << failed;
  EXPECT_NE(failed.find("donor2"), std::string::npos) << failed;
  // Every healthy donor delivered a share (the standby took over), and nobody served it all.
  EXPECT_GE(rep.donors_used.size(), 2u);
  for (int i : {0, 3}) {
    EXPECT_GT(donors[i]->donor->bytes_served(), 0u) << i;
    EXPECT_LT(donors[i]->donor->bytes_served(), state.size()) << i;
  }
}

// A newcomer arriving while the swarm steps finds some donors a step behind (mid-step when
// asked). They are asked again while the download runs, and one that reaches the state joins:
// here the only donor of the state dies after 2 MB, and the one that was a step behind finishes
// the download once it has stepped. Without it (the control) the same download fails.
TEST(StateDownload, ADonorAStepBehindJoinsOnceItStepsAndFinishesWhatADeadOneBegan) {
  const std::string state = random_state(8 << 20, 5);
  auto o = small_pieces();
  for (const bool with_behind : {false, true}) {
    Donor ahead("ahead", 5, state), behind("behind", 4, random_state(8 << 20, 6));
    ahead.donor->die_after(2u << 20);
    std::thread stepper([&] {
      std::this_thread::sleep_for(300ms);
      behind.donor->publish(5, state);  // its step ends: the same state as the swarm's
    });
    hm::DownloadReport rep;
    const auto got = hm::download_state({ahead.info}, o, &rep,
                                        with_behind ? std::vector<hm::DonorInfo>{behind.info} : std::vector<hm::DonorInfo>{});
    stepper.join();
    if (!with_behind) {
      EXPECT_FALSE(got.has_value());
      EXPECT_NE(rep.why_none.find("every donor failed"), std::string::npos) << rep.why_none;
      continue;
    }
    ASSERT_TRUE(got.has_value()) << rep.why_none;
    EXPECT_TRUE(got->bytes == state);
    EXPECT_EQ(got->epoch, 5);
    ASSERT_EQ(rep.donors_failed.size(), 1u);
    EXPECT_NE(rep.donors_failed[0].find("ahead"), std::string::npos) << rep.donors_failed[0];
    EXPECT_EQ(rep.donors_used.size(), 2u);
    EXPECT_GT(behind.donor->bytes_served(), 0u);
    EXPECT_GE(rep.seconds, 0.25);  // it waited for the step, not less
  }
}

TEST(StateDownload, ADonorThatStepsMidDownloadStillServesTheStateAnnounced) {
  const std::string state = random_state(8 << 20, 2);
  Donor d("donor0", 3, state);
  auto o = small_pieces();
  std::thread stepper([&] {
    while (d.donor->bytes_served() < (1u << 20)) std::this_thread::sleep_for(1ms);
    d.donor->publish(4, random_state(8 << 20, 3));  // its next step
  });
  hm::DownloadReport rep;
  const auto got = hm::download_state({d.info}, o, &rep);
  stepper.join();
  ASSERT_TRUE(got.has_value()) << rep.why_none;
  EXPECT_TRUE(got->bytes == state);
  EXPECT_EQ(d.donor->info().epoch, 4);
  // Two steps later the announced state is gone: the newcomer is told, not served other bytes.
  d.donor->publish(5, random_state(8 << 20, 4));
  const auto stale = hm::download_state({d.info}, o, &rep);
  EXPECT_FALSE(stale.has_value());
  EXPECT_NE(rep.why_none.find("every donor failed"), std::string::npos) << rep.why_none;
  ASSERT_EQ(rep.donors_failed.size(), 1u);
  EXPECT_NE(rep.donors_failed[0].find("no longer holds that state"), std::string::npos) << rep.donors_failed[0];
}

TEST(StateDownload, SilentDonorsEndAtTheOneDeadlineAndChoiceFollowsEpochThenMajority) {
  // A donor that accepts and never answers: the download ends by next_chunk_timeout, named.
  hm::Server silent("127.0.0.1:0", [](hm::Connection& c) {
    try {
      c.receive(hm::after(10s), 1 << 20);
      c.receive(hm::after(10s), 1 << 20);  // until the requester gives up or the server stops
    } catch (const hm::NetError&) {
    }
  });
  hm::DonorInfo info{"mute", silent.address(), 1, 1 << 20, hm::digest32("x")};
  auto o = small_pieces();
  o.next_chunk_timeout = 500ms;
  hm::DownloadReport rep;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(hm::download_state({info}, o, &rep).has_value());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  ASSERT_EQ(rep.donors_failed.size(), 1u);
  EXPECT_NE(rep.donors_failed[0].find("mute"), std::string::npos);
  silent.stop();

  // Choice: the state (epoch, digest, size) most donors announce, the newest on a tie; oversize,
  // stale and unvouched (above max_epoch) ones dropped. A lone donor far ahead (a forged epoch)
  // does not beat two that agree.
  const auto a = hm::digest32("a"), b = hm::digest32("b");
  std::vector<hm::DonorInfo> all = {{"old", "h:1", 3, 10, a},   {"b1", "h:2", 4, 10, b},  {"a1", "h:3", 4, 10, a},
                                    {"a2", "h:4", 4, 10, a},    {"big", "h:5", 9, uint64_t{1} << 40, a},
                                    {"forger", "h:6", 5000, 10, b}};
  o.max_bytes = 1 << 20;
  auto chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 2u);
  for (const auto& d : chosen) EXPECT_EQ(d.peer_id[0], 'a');
  o.max_epoch = 3;
  chosen = hm::choose_donors(all, o);
  ASSERT_EQ(chosen.size(), 1u);
  EXPECT_EQ(chosen[0].peer_id, "old");
  o.max_epoch = INT64_MAX;
  all.push_back({"b2", "h:7", 4, 10, b});
  all.push_back({"c1", "h:8", 6, 10, b});
  all.push_back({"c2", "h:9", 6, 10, b});
  chosen = hm::choose_donors(all, o);  // (4, a), (4, b) and (6, b) have 2 each: the newest
  ASSERT_EQ(chosen.size(), 2u);
  for (const auto& d : chosen) EXPECT_EQ(d.peer_id[0], 'c');
  all.resize(6);
  o.min_epoch = 5;
  o.max_epoch = 4999;
  EXPECT_TRUE(hm::choose_donors(all, o).empty());
  EXPECT_FALSE(hm::download_state({}, o, &rep).has_value());
  EXPECT_FALSE(rep.why_none.empty());

  // Announcements and manifests: what is encoded decodes; truncated or empty ones do not.
  const std::string enc = hm::encode_donor(all[1]);
  const auto dec = hm::decode_donor(enc);
  ASSERT_TRUE(dec.has_value());
  EXPECT_EQ(dec->address, "h:2");
  EXPECT_EQ(dec->epoch, 4);
  EXPECT_FALSE(hm::decode_donor(enc.substr(0, enc.size() - 1)).has_value());
  EXPECT_FALSE(hm::decode_donor("").has_value());
  const std::string man = hm::encode_manifest(all[1]);
  const auto m = hm::decode_manifest(man);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->size, 10u);
  EXPECT_TRUE(m->digest == b);
  EXPECT_FALSE(hm::decode_manifest(man.substr(0, man.size() - 1)).has_value());
}

TEST(StateDownload, DonorsSnapshotOnDemandOncePerEpochAndServeWhatTheyAnnounced) {
  hm::Router router;
  hm::Server server("127.0.0.1:0", router.handler());
  hm::StateDonor donor(nullptr, router, "run_state", server.address());
  std::atomic<int64_t> epoch{3};
  std::atomic<int> calls{0};
  donor.set_provider([&] {
    ++calls;
    return hm::StateSnapshot{epoch.load(), random_state(3 << 20, static_cast<uint64_t>(epoch.load())), {}};
  });
  EXPECT_EQ(donor.info().size, 0u);  // nothing made while nobody asked
  std::string why;
  // Three newcomers asking at once share one snapshot.
  std::vector<std::optional<hm::DonorInfo>> got(3);
  std::vector<std::thread> asks;
  for (auto& g : got) asks.emplace_back([&] { g = hm::fetch_manifest(server.address(), 3, hm::after(5s)); });
  for (auto& t : asks) t.join();
  for (auto& g : got) {
    ASSERT_TRUE(g.has_value());
    EXPECT_EQ(g->epoch, 3);
    EXPECT_EQ(g->size, 3u << 20);
    EXPECT_TRUE(g->digest == hm::digest32(random_state(3 << 20, 3)));
  }
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(donor.snapshots_made(), 1u);
  // A newer epoch makes a new one; an epoch the peer has not reached is refused, named.
  epoch = 4;
  const auto m4 = hm::fetch_manifest(server.address(), 4, hm::after(5s));
  ASSERT_TRUE(m4.has_value());
  EXPECT_EQ(calls.load(), 2);
  EXPECT_FALSE(hm::fetch_manifest(server.address(), 9, hm::after(5s), &why).has_value());
  EXPECT_NE(why.find("no state at epoch 9"), std::string::npos) << why;
  // And the manifest's state downloads.
  hm::DonorInfo d = *m4;
  d.peer_id = "donor";
  auto o = small_pieces();
  hm::DownloadReport rep;
  const auto s = hm::download_state({d}, o, &rep);
  ASSERT_TRUE(s.has_value()) << rep.why_none;
  EXPECT_TRUE(s->bytes == random_state(3 << 20, 4));
  server.stop();
}
