// What authenticated rounds cost (group_auth.h): each signature operation alone, and a butterfly
// round of PEERS members over loopback with signed hellos against the same round unsigned.
//   bench_hivemind_auth [PEERS=4] [ELEMENTS=1000] [ROUNDS=100]
// Peers run as threads of this process, each with its own TCP server. A small vector keeps the
// round short, so the signatures' share shows; the modes alternate twice to expose drift.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/group_auth.h"
#include "polytrain/swarm/record.h"

namespace hm = polytrain::hivemind;
using Clock = std::chrono::steady_clock;

namespace {

template <typename F>
double mean_us(int reps, F f) {
  const auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r) f();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / reps;
}

// A group as matchmaking would form it: member 0 leads, every other member with its signed join.
hm::Group signed_group(const std::vector<std::shared_ptr<const hm::Identity>>& ids,
                       const std::vector<std::unique_ptr<hm::AveragingPeer>>& peers) {
  hm::Group g;
  g.members.push_back(hm::Member{ids[0]->peer_id(), peers[0]->address(), 1.0});
  for (size_t i = 1; i < ids.size(); ++i) {
    hm::Join j;
    j.key = "bench_grad_0";
    j.member = hm::Member{ids[i]->peer_id(), peers[i]->address(), 1.0};
    j.leader = ids[0]->peer_id();
    j.member.join = hm::seal_join(j, *ids[i]);
    g.members.push_back(j.member);
  }
  return g;
}

// The slowest member's time of each round, sorted (microseconds).
std::vector<double> rounds(hm::Group g, const std::vector<std::shared_ptr<const hm::Identity>>& ids,
                           std::vector<std::unique_ptr<hm::AveragingPeer>>& peers, size_t n, int count, bool sign,
                           int pass) {
  std::vector<double> out;
  for (int r = 0; r < count; ++r) {
    std::vector<std::vector<float>> v(peers.size(), std::vector<float>(n, 1.0f));
    std::vector<double> secs(peers.size());
    std::vector<std::thread> t;
    for (size_t i = 0; i < peers.size(); ++i)
      t.emplace_back([&, i] {
        hm::Group gi = g;
        gi.self = i;
        gi.group_id = (sign ? "signed/" : "plain/") + std::to_string(pass) + "/" + std::to_string(r);
        if (sign) gi.identity = ids[i];
        secs[i] = peers[i]->averager.allreduce(gi, v[i].data(), n, 1.0, hm::AllReduceOptions{}).seconds;
      });
    for (auto& th : t) th.join();
    out.push_back(*std::max_element(secs.begin(), secs.end()) * 1e6);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t k = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 4;
  const size_t n = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1000;
  const int count = argc > 3 ? std::atoi(argv[3]) : 100;
  if (k < 2 || n == 0 || count < 10) return std::fprintf(stderr, "usage: bench_hivemind_auth [PEERS>=2] [ELEMENTS>0] [ROUNDS>=10]\n"), 2;
  std::vector<std::shared_ptr<const hm::Identity>> ids;
  std::vector<std::unique_ptr<hm::AveragingPeer>> peers;
  for (size_t i = 0; i < k; ++i) {
    ids.push_back(std::make_shared<hm::Identity>(hm::Identity::generate()));
    peers.push_back(std::make_unique<hm::AveragingPeer>(false));
  }
  hm::Group g = signed_group(ids, peers);
  g.group_id = "bench";
  const hm::LeaderView leader{ids[0]->peer_id(), peers[0]->address(), 1.0};
  std::string sealed, sig;
  const std::string hello(60, 'h');
  const int reps = 200;
  const double seal = mean_us(reps, [&] { sealed = hm::seal_group(g, *ids[0]); });
  const double open = mean_us(reps, [&] { (void)hm::open_group(sealed, leader, "bench_grad_0", ids[1]->peer_id(), k); });
  const double sign = mean_us(reps, [&] { sig = hm::sign_hello(*ids[1], ids[0]->peer_id(), hello); });
  const double verify = mean_us(reps, [&] { (void)hm::hello_signed_by(ids[1]->peer_id(), ids[0]->peer_id(), hello, sig); });
  std::printf("mean of %d: seal a list %.1f us, open a list of %zu %.1f us, sign a hello %.1f us, verify one %.1f us\n",
              reps, seal, k, open, sign, verify);
  std::printf("a follower's signature work per round, serial: %.1f us (one list, %zu hellos signed and verified)\n",
              open + static_cast<double>(k - 1) * (sign + verify), k - 1);
  for (int pass = 0; pass < 2; ++pass)
    for (bool signed_hellos : {false, true}) {
      const auto t = rounds(g, ids, peers, n, count, signed_hellos, pass);
      std::printf("%s hellos: %zu members, %zu floats, slowest member per round: median %.0f us (p10 %.0f, p90 %.0f)\n",
                  signed_hellos ? "signed  " : "unsigned", k, n, t[t.size() / 2], t[t.size() / 10], t[t.size() * 9 / 10]);
    }
  for (auto& p : peers) p->server->stop();
  return 0;
}
