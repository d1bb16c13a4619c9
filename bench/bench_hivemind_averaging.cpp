// Butterfly all-reduce throughput over loopback TCP (env_type hivemind), against the loopback
// TCP bandwidth this same binary measures with the same framed streams.
//   bench_hivemind_averaging [MAX_MB=256] [PEERS=2,4,8] [COMPRESSION=none]
// Peers run as threads of this process, each with its own TCP server: every byte crosses the
// kernel's loopback as it would between processes. Figures per row:
//   algbw = vector bytes / round time; busbw = algbw * 2 (g-1) / g, the bytes each peer sends
//   and receives per second (NCCL's convention), compared with one TCP stream's bandwidth.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/parallel/hivemind/butterfly.h"
#include "polytrain/parallel/hivemind/wire.h"

#include "loopback_tcp.h"

namespace hm = polytrain::hivemind;
using namespace std::chrono_literals;

namespace {

using Peer = hm::AveragingPeer;

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
  const double link = loopback_tcp_bandwidth(size_t{1} << 30);
  std::printf("loopback TCP, one stream, 1 MiB frames: %.2f GB/s (%u cores)\n", link / 1e9,
              std::thread::hardware_concurrency());
  std::printf("%5s %8s %10s %10s %10s %8s  compression %s\n", "peers", "MB", "round s", "algbw GB/s", "busbw GB/s",
              "of link", hm::compression_name(o.compression));
  for (int g : groups) {
    std::vector<std::unique_ptr<Peer>> peers;
    for (int i = 0; i < g; ++i) peers.push_back(std::make_unique<Peer>());
    for (size_t mb = 16; mb <= max_mb; mb *= 4) {
      const size_t n = mb * (size_t{1} << 20) / 4;
      std::vector<std::vector<float>> v(g, std::vector<float>(n, 1.0f));
      hm::Group group;
      for (int i = 0; i < g; ++i) group.members.push_back({"p" + std::to_string(i), peers[i]->server->address(), 1.0});
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
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
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      const double algbw = static_cast<double>(n) * 4 / best;
      const double busbw = algbw * 2.0 * (g - 1) / g;
      std::printf("%5d %8zu %10.3f %10.2f %10.2f %7.0f%%\n", g, mb, best, algbw / 1e9, busbw / 1e9,
                  100.0 * busbw / link);
      std::fflush(stdout);
    }
  }
  return 0;
}
