// Worker side of bench/ddp.sh, started by `launch`:
//   bench_ddp step STEPS MICRO [dense] [bucket_bytes=N] [no_overlap]
//     tiny BERT (hidden 128, 2 layers, seq 128, vocab 30522) training steps, one thread per
//     rank; world 1 runs env_type pytorch (no communication at all), more ranks pytorchDDP.
//     Rank 0 prints ms_per_step, samples_per_s_per_rank, exposed_comm_ms_per_step, buckets.
//   bench_ddp comm
//     all_reduce bus bandwidth of the communicator the environment selects (gloo, or mpi
//     under mpirun) at 1, 16 and 64 MB, next to this machine's memcpy bandwidth.
//   bench_ddp ceiling N
//     the hardware's ceiling for the same all-reduces among N ranks of this host (no launcher):
//     N threads over N buffers in one address space, each averaging its slice of every buffer
//     and writing it back into all of them, next to memcpy with N threads copying at once.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/models/bert.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/single/single_backend.h"

using namespace polytrain;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int bench_step(int argc, char** argv) {
  const int steps = std::stoi(argv[2]);
  const int64_t micro = std::stoll(argv[3]);
  bool dense = false, overlap = true;
  int64_t bucket = 25000000;
  for (int i = 4; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "dense") dense = true;
    if (a == "no_overlap") overlap = false;
    if (a.rfind("bucket_bytes=", 0) == 0) bucket = std::stoll(a.substr(13));
  }
  Config cfg;
  cfg.batch.train_micro_batch_size_per_gpu = micro;
  cfg.batch.gradient_accumulation_steps = 1;
  cfg.optimizer.type = "AdamW";
  cfg.optimizer.lr = 1e-4;
  cfg.optimizer.weight_decay = 0.01;
  cfg.gradient_clipping = 1.0;
  cfg.trainer.reduce_bucket_size = bucket;
  cfg.trainer.overlap_comm = overlap;
  const char* ws = std::getenv("WORLD_SIZE");
  const bool single = !ws || std::string(ws) == "1";
  cfg.trainer.env_type = single ? "pytorch" : "pytorchDDP";
  auto& mc = cfg.model;
  mc.hidden_size = 128, mc.num_hidden_layers = 2, mc.num_attention_heads = 2, mc.intermediate_size = 512;
  torch::manual_seed(0);
  auto model = BertForMaskedLM(mc);
  model->fused_lm_loss_ = !dense;
  std::unique_ptr<Backend> backend;
  DdpBackend* ddp = nullptr;
  if (single) {
    backend = std::make_unique<SingleBackend>(cfg);
  } else {
    auto d = std::make_unique<DdpBackend>(cfg);
    ddp = d.get();
    backend = std::move(d);
  }
  backend->prepare(model.ptr(), cfg);
  const int rank = static_cast<int>(backend->context().rank);
  torch::manual_seed(100 + rank);  // each rank its own fixed batch
  auto ids = torch::randint(1000, mc.vocab_size, {micro, 128}, torch::kLong);
  auto labels = torch::where(torch::rand({micro, 128}) < 0.15, ids, torch::full_like(ids, -100));
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  auto one = [&] {
    backend->backward(model->forward(ids, am, tt, labels).loss, MicroStep{micro, true});
    backend->step(StepRequest{1e-4, std::nullopt, 1.0}, 0);
  };
  one();  // warm-up
  const double exposed0 = ddp ? ddp->exposed_comm_seconds() : 0.0;
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) one();
  const double s = seconds_since(t0) / steps;
  const double exposed = ddp ? (ddp->exposed_comm_seconds() - exposed0) / steps : 0.0;
  if (rank == 0) {
    std::printf("ms_per_step %.2f\nsamples_per_s_per_rank %.2f\nexposed_comm_ms_per_step %.2f\nbuckets %zu\n", s * 1e3,
                micro / s, exposed * 1e3, ddp ? ddp->bucket_count() : size_t{0});
  }
  return 0;
}

int bench_comm() {
  CommOptions o;
  auto comm = make_communicator(o);
  const int n = comm->size();
  // memcpy bandwidth on this machine: bytes copied per second by one large copy (each byte read
  // once and written once), every rank copying at the same time (a barrier starts them), as an
  // all-reduce's ranks do; the best of 3 rounds of 5 copies of 64 MB.
  auto src = torch::rand({16 << 20}), dst = torch::empty_like(src);
  dst.copy_(src);
  double memcpy_gbs = 0;
  for (int round = 0; round < 3; ++round) {
    comm->barrier();
    const auto c0 = Clock::now();
    for (int i = 0; i < 5; ++i) dst.copy_(src);
    memcpy_gbs = std::max(memcpy_gbs, 5.0 * src.numel() * 4 / seconds_since(c0) / 1e9);
  }
  auto t0 = Clock::now();
  for (int64_t mb : {1, 16, 64}) {
    auto t = torch::ones({mb * (1 << 20) / 4});
    comm->all_reduce(t);
    comm->barrier();
    const int iters = mb >= 64 ? 5 : 20;
    t0 = Clock::now();
    for (int i = 0; i < iters; ++i) comm->all_reduce(t);
    const double s = seconds_since(t0) / iters;
    // nccl-tests' bus bandwidth: what each rank must move for an all-reduce, 2 (n-1)/n bytes.
    const double busbw = 2.0 * (n - 1) / n * t.numel() * 4 / s / 1e9;
    if (comm->rank() == 0) {
      std::printf("%s world %d all_reduce %3lld MB: %8.2f ms, bus bandwidth %6.2f GB/s, memcpy %6.2f GB/s, ratio %.3f\n",
                  comm->engine().c_str(), n, static_cast<long long>(mb), s * 1e3, busbw, memcpy_gbs, busbw / memcpy_gbs);
    }
  }
  return 0;
}

// A sense-reversing spin barrier for `n` threads (each on its own core here).
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait(int& generation) {
    if (arrived_.fetch_add(1) + 1 == n_) {
      arrived_.store(0);
      phase_.store(generation + 1);
    } else {
      while (phase_.load() == generation) {
      }
    }
    ++generation;
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0}, phase_{0};
};

// What a single-copy shared-memory all-reduce must move at least: rank r reads slice r of every
// rank's buffer once and writes the average back into each (no staging copies, no messages).
// No engine can beat it on this machine; engines are reported against it as well as memcpy.
int bench_ceiling(int n) {
  for (int64_t mb : {1, 16, 64}) {
    const size_t count = static_cast<size_t>(mb) * (1 << 20) / 4;
    std::vector<std::vector<float>> bufs(n, std::vector<float>(count, 1.0f)), dst(n, std::vector<float>(count));
    const int iters = mb >= 64 ? 5 : 20;
    SpinBarrier barrier(n);
    double reduce_s = 0, copy_s = 0;
    auto worker = [&](int r) {
      int gen = 0;
      const size_t begin = count * r / n, end = count * (r + 1) / n;
      const float inv = 1.0f / static_cast<float>(n);
      constexpr size_t kChunk = 4096;
      alignas(64) float acc[kChunk];
      for (int round = 0; round < 2; ++round) {  // round 0 warms up
        barrier.wait(gen);
        const auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) {
          for (size_t c = begin; c < end; c += kChunk) {  // a chunk in L1: vectorised passes
            const size_t len = std::min(kChunk, end - c);
            const float* first = bufs[0].data() + c;
            for (size_t k = 0; k < len; ++k) acc[k] = first[k];
            for (int j = 1; j < n; ++j) {
              const float* b = bufs[j].data() + c;
              for (size_t k = 0; k < len; ++k) acc[k] += b[k];
            }
            for (size_t k = 0; k < len; ++k) acc[k] *= inv;
            for (int j = 0; j < n; ++j) std::copy(acc, acc + len, bufs[j].data() + c);
          }
          barrier.wait(gen);
        }
        if (r == 0 && round == 1) reduce_s = seconds_since(t0) / iters;
      }
      barrier.wait(gen);  // memcpy with every thread copying its own buffer at once
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) std::copy(bufs[r].begin(), bufs[r].end(), dst[r].begin());
      barrier.wait(gen);
      if (r == 0) copy_s = seconds_since(t0) / iters;
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back(worker, r);
    for (auto& t : threads) t.join();
    const double bytes = static_cast<double>(count) * 4;
    const double busbw = 2.0 * (n - 1) / n * bytes / reduce_s / 1e9, memcpy_gbs = bytes / copy_s / 1e9;
    std::printf("ceiling world %d all_reduce %3lld MB: %8.2f ms, bus bandwidth %6.2f GB/s, memcpy %6.2f GB/s, ratio %.3f\n",
                n, static_cast<long long>(mb), reduce_s * 1e3, busbw, memcpy_gbs, busbw / memcpy_gbs);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "step" && argc >= 4) return bench_step(argc, argv);
  if (mode == "comm") return bench_comm();
  if (mode == "ceiling" && argc >= 3) return bench_ceiling(std::max(1, std::stoi(argv[2])));
  std::fprintf(stderr,
               "usage: bench_ddp step STEPS MICRO [dense] [bucket_bytes=N] [no_overlap] | bench_ddp comm | bench_ddp ceiling N\n");
  return 2;
}
