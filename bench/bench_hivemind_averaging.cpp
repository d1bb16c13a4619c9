// Butterfly all-reduce throughput over loopback TCP (env_type hivemind), against the loopback
// TCP bandwidth this same binary measures with the same framed streams.
//   bench_hivemind_averaging [MAX_MB=256] [PEERS=2,4,8] [COMPRESSION=none]
// Peers run as threads of this process, each with its own TCP server: every byte crosses the
// kernel's loopback as it would between processes. Figures per row:
//   algbw = vector bytes / round time; busbw = algbw * 2 (g-1) / g, the bytes each peer sends
//   and receives per second (NCCL's convention), compared with one TCP stream's bandwidth
//   (best of 3: it is bimodal here, by whether the two ends share a core), and with the
//   machine's ceiling for this traffic: the same bytes between the same g peers' threads over
//   the same framed streams with nothing else done (no reduction, no copies, no barrier). All
//   g peers share this machine's cores, so at g > 2 on 2 cores the ceiling, not the link, binds.
//   `cores`: the round's CPU time (all threads, user + system) over its wall time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/wire.h"

#include "loopback_tcp.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;

namespace {

using Peer = hm::AveragingPeer;

// Seconds for the butterfly's traffic alone: each of g peers streams part_bytes to each other
// peer, which streams as many back (both phases of the round), all at once.
double exchange_seconds(int g, size_t part_bytes) {
  // Streams send from a vector's worth of memory written beforehand, as the round sends from
  // the vector (one hot 1 MiB buffer would flatter the ceiling: the kernel would copy from cache).
  constexpr size_t kFrame = size_t{1} << 20;
  const std::string src(part_bytes * static_cast<size_t>(g), 'x');
  auto stream = [&](hm::Connection& c, size_t bytes, size_t part) {
    const std::string_view from = std::string_view(src).substr(part * part_bytes, bytes);
    for (size_t sent = 0; sent < bytes; sent += kFrame)
      c.send(1, from.substr(sent, std::min(kFrame, bytes - sent)), hm::after(60s));
  };
  auto drain = [](hm::Connection& c, size_t bytes) {
    for (size_t got = 0; got < bytes;) got += c.receive(hm::after(60s), size_t{1} << 21).payload.size();
  };
  std::vector<std::unique_ptr<hm::Server>> servers;
  for (int i = 0; i < g; ++i)
    servers.push_back(std::make_unique<hm::Server>("127.0.0.1:0", [&, i](hm::Connection& c) {
      drain(c, part_bytes);
      stream(c, part_bytes, static_cast<size_t>(i));
    }));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> t;
  for (int i = 0; i < g; ++i)
    for (int j = 0; j < g; ++j)
      if (i != j)
        t.emplace_back([&, j] {
          auto c = hm::Connection::connect(servers[j]->address(), hm::after(10s));
          stream(*c, part_bytes, static_cast<size_t>(j));
          drain(*c, part_bytes);
        });
  for (auto& th : t) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const size_t max_mb = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  std::vector<int> groups = {2, 4, 8};
  if (argc > 2) {
    groups.clear();
    std::stringstream ss(argv[2]);
    for (std::string t; std::getline(ss, t, ',');) groups.push_back(std::stoi(t));
  }
  hm::AllReduceOptions o;
  o.compression = hm::parse_compression(argc > 3 ? argv[3] : "none");
  o.allreduce_timeout = 600s;
  o.next_chunk_timeout = 60s;
  double link_cores = 0;
  const double link = loopback_tcp_bandwidth(size_t{1} << 29, 3, &link_cores);
  std::printf("loopback TCP, one stream, 1 MiB frames: %.2f GB/s, keeping %.2f of the %u cores busy\n", link / 1e9,
              link_cores, std::thread::hardware_concurrency());
  std::printf("%5s %8s %10s %10s %10s %8s %12s %10s %6s  compression %s\n", "peers", "MB", "round s", "algbw GB/s",
              "busbw GB/s", "of link", "ceiling s", "of ceiling", "cores", hm::compression_name(o.compression));
  for (int g : groups) {
    std::vector<std::unique_ptr<Peer>> peers;
    for (int i = 0; i < g; ++i) peers.push_back(std::make_unique<Peer>());
    for (size_t mb = 16; mb <= max_mb; mb *= 4) {
      const size_t n = mb * (size_t{1} << 20) / 4;
      std::vector<std::vector<float>> v(g, std::vector<float>(n, 1.0f));
      hm::Group group;
      for (int i = 0; i < g; ++i) group.members.push_back({"p" + std::to_string(i), peers[i]->server->address(), 1.0});
      double best = 1e30, best_cpu = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const double cpu0 = process_cpu_seconds();
        group.group_id = "bench-" + std::to_string(g) + "-" + std::to_string(mb) + "-" + std::to_string(rep);
        std::vector<std::thread> t;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < g; ++i)
          t.emplace_back([&, i] {
            auto gi = group;
            gi.self = i;
            auto r = peers[i]->averager.allreduce(gi, v[i].data(), n, 1.0, o);
            if (!r.warning().empty()) std::fprintf(stderr, "peer %d: %s\n", i, r.warning().c_str());
          });
        for (auto& th : t) th.join();
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (secs < best) best = secs, best_cpu = (process_cpu_seconds() - cpu0) / secs;
      }
      double ceiling = 1e30;
      for (int rep = 0; rep < 3; ++rep) ceiling = std::min(ceiling, exchange_seconds(g, n * 4 / g));
      const double algbw = static_cast<double>(n) * 4 / best;
      const double busbw = algbw * 2.0 * (g - 1) / g;
      std::printf("%5d %8zu %10.3f %10.2f %10.2f %7.0f%% %12.3f %9.0f%% %6.2f\n", g, mb, best, algbw / 1e9,
                  busbw / 1e9, 100.0 * busbw / link, ceiling, 100.0 * ceiling / best, best_cpu);
      std::fflush(stdout);
    }
  }
  return 0;
}
