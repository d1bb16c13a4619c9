// The swarm's control plane and state download on loopback (env_type hivemind), each figure
// next to its goal and to the link this binary measures:
//   bench_hivemind_swarm [PEERS=8] [STATE_MB=100]
//  1. connect: PEERS DHT nodes start at once, each joining through the first and publishing
//     a progress record; time until every node reads all PEERS records (goal <= 3 s);
//  2. progress latency: a record published by one node until another node's read sees it,
//     100 times (goal p95 <= 50 ms);
//  3. state download: STATE_MB from 1, 2 and 4 donors (hivemind takes one donor), against one
//     TCP stream of the same framed connections (the loopback's bandwidth);
//  4. an idle peer (DHT node, progress tracker, donor, averaging server) for 10 s: CPU used
//     (goal < 2% of a core); and the time to shut it down (goal <= 1 s).
// Nodes and donors are threads of this process; every byte crosses the kernel's loopback.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/progress.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/state.h"
#include "polytrain/swarm/wire.h"

#include "loopback_tcp.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

hm::ProgressTracker::Options progress_options(const std::string& run) {
  return hm::ProgressTracker::Options{run + "_progress", 1 << 20, false, 60.0, 0.0};
}

}  // namespace

int main(int argc, char** argv) {
  const int peers = argc > 1 ? std::atoi(argv[1]) : 8;
  const size_t state_mb = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 100;
  std::printf("hivemind swarm on loopback, %u cores\n", std::thread::hardware_concurrency());

  // 1. connect
  {
    const std::string run = "bench-connect-" + std::to_string(::getpid());
    hm::DhtOptions o;
    o.run_id = run;
    o.listen = "127.0.0.1:0";
    const auto t0 = Clock::now();
    std::vector<std::unique_ptr<hm::DhtNode>> nodes(peers);
    std::vector<std::unique_ptr<hm::ProgressTracker>> trackers(peers);
    nodes[0] = std::make_unique<hm::DhtNode>(o, std::make_shared<hm::Identity>(hm::Identity::generate()));
    trackers[0] = std::make_unique<hm::ProgressTracker>(*nodes[0], progress_options(run), 0);
    o.initial_peers = {nodes[0]->address()};
    std::vector<std::thread> starts;
    for (int i = 1; i < peers; ++i)
      starts.emplace_back([&, i] {
        nodes[i] = std::make_unique<hm::DhtNode>(o, std::make_shared<hm::Identity>(hm::Identity::generate()));
        trackers[i] = std::make_unique<hm::ProgressTracker>(*nodes[i], progress_options(run), 0);
      });
    for (auto& t : starts) t.join();
    const double started = since(t0);
    std::vector<double> seen_at(peers, -1.0);
    while (since(t0) < 30.0) {
      bool all = true;
      for (int i = 0; i < peers; ++i) {
        if (seen_at[i] >= 0) continue;
        if (static_cast<int>(nodes[i]->fetch(run + "_progress", 1s).size()) >= peers) seen_at[i] = since(t0);
        else all = false;
      }
      if (all) break;
      std::this_thread::sleep_for(5ms);
    }
    const double worst = *std::max_element(seen_at.begin(), seen_at.end());
    std::printf("connect: %d nodes started in %.2f s; every node reads all %d progress records after %.2f s "
                "(goal <= 3 s)%s\n",
                peers, started, peers, worst, std::count(seen_at.begin(), seen_at.end(), -1.0) ? " [SOME NEVER DID]" : "");

    // 2. progress latency, node 1 -> node peers-1
    std::vector<double> lat;
    auto& w = *nodes[1];
    auto& r = *nodes[peers - 1];
    for (int k = 0; k < 100; ++k) {
      trackers[1]->report_local_step(1, 0.01);
      const int64_t want = trackers[1]->local_samples();
      const auto t1 = Clock::now();
      trackers[1]->publish_now();
      for (;;) {
        bool seen = false;
        for (const auto& rec : r.fetch(run + "_progress", 1s))
          if (rec.owner == w.identity().public_key())
            if (auto p = hm::decode_progress(rec.payload); p && p->samples_accumulated == want) seen = true;
        if (seen || since(t1) > 5.0) break;
      }
      lat.push_back(1e3 * since(t1));
    }
    std::printf("progress record, publish -> seen by another node: p50 %.1f ms, p95 %.1f ms, max %.1f ms over %zu "
                "(goal p95 <= 50 ms)\n",
                percentile(lat, 0.5), percentile(lat, 0.95), percentile(lat, 1.0), lat.size());
    const auto t2 = Clock::now();
    trackers.clear();
    nodes.clear();
    std::printf("connect: %d nodes left the swarm in %.2f s\n", peers, since(t2));
  }

  // 3. state download
  {
    const double link = loopback_tcp_bandwidth(size_t{1} << 30);
    std::printf("loopback TCP, one stream, 1 MiB frames: %.2f GB/s\n", link / 1e9);
    std::string state(state_mb << 20, '\0');
    std::mt19937_64 rng(1);
    for (size_t i = 0; i + 8 <= state.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(&state[i], &v, 8);
    }
    // The floor of a download on this machine, whatever the network: the result written into
    // fresh memory (page faults dominate on these VMs) and its BLAKE2b digest checked once.
    double floor_s = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      std::string fresh(state.size(), '\0');
      std::memcpy(fresh.data(), state.data(), state.size());
      const auto d = hm::digest32(fresh);
      floor_s = std::min(floor_s, since(t0));
      if (d[0] == 0x5a && d[1] == 0xa5) std::printf(" ");  // keeps the work observable
    }
    std::printf("floor: %zu MB into fresh memory + its BLAKE2b digest: %.3f s\n", state_mb, floor_s);
    struct Donor {
      hm::Router router;
      std::unique_ptr<hm::Server> server;
      std::unique_ptr<hm::StateDonor> donor;
      hm::DonorInfo info;
    };
    std::vector<std::unique_ptr<Donor>> donors;
    for (int i = 0; i < 4; ++i) {
      auto d = std::make_unique<Donor>();
      d->server = std::make_unique<hm::Server>("127.0.0.1:0", d->router.handler());
      d->donor = std::make_unique<hm::StateDonor>(nullptr, d->router, "bench_state", d->server->address());
      d->donor->publish(7, state);
      d->info = d->donor->info();
      d->info.peer_id = "donor" + std::to_string(i);
      donors.push_back(std::move(d));
    }
    for (size_t n : {size_t{1}, size_t{2}, size_t{4}}) {
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<hm::DonorInfo> infos;
        for (size_t i = 0; i < n; ++i) infos.push_back(donors[i]->info);
        hm::DownloadOptions o;
        o.max_donors = n;
        o.seed = 1 + rep;
        hm::DownloadReport rep_;
        const auto t0 = Clock::now();
        const auto got = hm::download_state(infos, o, &rep_);
        const double s = since(t0);
        if (!got || got->bytes != state) {
          std::printf("state download from %zu donor(s) FAILED: %s\n", n, rep_.why_none.c_str());
          return 1;
        }
        best = std::min(best, s);
      }
      const double bw = static_cast<double>(state.size()) / best;
      std::printf("state download %zu MB from %zu donor(s): %.3f s, %.2f GB/s, %.0f%% of one loopback stream, "
                  "%.2f x the floor (CRC-32C per 1 MiB chunk, BLAKE2b of the whole)\n",
                  state_mb, n, best, bw / 1e9, 100.0 * bw / link, best / floor_s);
    }
  }

  // 4. an idle peer, and its shutdown
  {
    const std::string run = "bench-idle-" + std::to_string(::getpid());
    hm::DhtOptions o;
    o.run_id = run;
    o.listen = "127.0.0.1:0";
    auto other = std::make_unique<hm::DhtNode>(o, std::make_shared<hm::Identity>(hm::Identity::generate()));
    o.initial_peers = {other->address()};
    const double c_other0 = cpu_seconds();
    std::this_thread::sleep_for(2s);
    const double other_alone = (cpu_seconds() - c_other0) / 2.0;
    auto dht = std::make_unique<hm::DhtNode>(o, std::make_shared<hm::Identity>(hm::Identity::generate()));
    auto avg = std::make_unique<hm::AveragingPeer>();
    auto donor = std::make_unique<hm::StateDonor>(dht.get(), avg->router, run + "_state", avg->address());
    donor->announce(0);
    auto tracker = std::make_unique<hm::ProgressTracker>(*dht, progress_options(run), 0);
    std::this_thread::sleep_for(2s);  // settle
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(10s);
    const double used = (cpu_seconds() - c0) / since(t0) - other_alone;
    std::printf("idle peer (DHT node, progress tracker, donor, averaging server) for 10 s: %.2f%% of a core "
                "(the other node's own %.2f%% subtracted; goal < 2%%)\n",
                100.0 * used, 100.0 * other_alone);
    const auto t1 = Clock::now();
    tracker.reset();
    donor.reset();
    avg->server->stop();
    avg.reset();
    dht.reset();
    std::printf("idle peer shut down in %.3f s (goal <= 1 s)\n", since(t1));
  }
  return 0;
}
