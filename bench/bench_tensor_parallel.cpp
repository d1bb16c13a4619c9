// env_type deepspeed+mpu on this machine: a GPT-2 (n_embd 256, 4 layers, 8 heads, GPT-2's
// 50257-token vocabulary, batch 4 x 128 tokens, dropout off) split over TP 1, 2 and 4 ranks
// (processes, 1 thread each, Gloo on loopback). Per rank and TP size it prints:
//   - parameter + optimizer (AdamW: 2 fp32 moments) bytes, and the 1/p expectation (replicated
//     LayerNorms and biases keep it above 1/p);
//   - activation bytes kept by the forward (malloc's in-use bytes after forward minus before);
//   - bytes all-reduced in the TP group per step against Megatron's count: 2 all-reduces
//     forward + 2 backward per layer of b*s*h elements, plus the vocab-parallel embedding's
//     forward all-reduce, the LM head's backward one and the cross entropy's 3 of b*s;
//   - step time (forward, backward, update), TP p against TP 1 in the same run;
//   - the distance to the machine's limits measured in the same process: one-thread fp32 GEMM
//     GFLOP/s (model FLOPs per step / step time against it) and the loopback all-reduce
//     bandwidth of the TP group (the step's all-reduce bytes / that bandwidth = the time its
//     communication needs at best).
// Usage: bench_tensor_parallel [steps=6]
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/parallel/comm/counting_communicator.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "../tests/helpers/free_port.h"  // a port the kernel says is free

using namespace polytrain;
using polytrain::testing::free_port;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kB = 4, kS = 128, kH = 256, kLayers = 4, kHeads = 8, kVocab = 50257;

double in_use_bytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double gemm_gflops() {
  auto a = torch::randn({512, 512}), b = torch::randn({512, 512});
  torch::mm(a, b);
  const auto t0 = Clock::now();
  int n = 0;
  while (seconds_since(t0) < 0.5) torch::mm(a, b), ++n;
  return 2.0 * 512 * 512 * 512 * n / seconds_since(t0) / 1e9;
}

struct RankResult {
  double param_bytes = 0, optim_bytes = 0, act_bytes = 0, ar_bytes_fwd = 0, ar_bytes_bwd = 0, ms_per_step = 0;
  double allreduce_gbps = 0, gemm = 0;
};

RankResult run_rank(int rank, int p, int port, int steps) {
  at::set_num_threads(1);
  nlohmann::json doc = {{"train_batch_size", kB},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}},
                        {"gradient_clipping", 1.0},
                        {"trainer", {{"env_type", "deepspeed+mpu"}, {"model_parallel_size", p}, {"seed", 1}}}};
  Config cfg = config_from_json(doc, "bench", p);
  auto world = std::make_unique<CountingCommunicator>(
      make_gloo_communicator(rank, p, "127.0.0.1", port, std::chrono::seconds(120)));
  DdpBackend backend(cfg, std::move(world));
  auto& tp = dynamic_cast<CountingCommunicator&>(backend.tp_group());
  torch::manual_seed(1);
  Gpt2Config mc;
  mc.vocab_size = kVocab, mc.n_positions = kS, mc.n_embd = kH, mc.n_layer = kLayers, mc.n_head = kHeads;
  mc.resid_pdrop = mc.embd_pdrop = mc.attn_pdrop = 0.0;
  auto model = Gpt2LMHeadModel(mc).ptr();
  backend.prepare(model, cfg);
  RankResult r;
  for (const auto& t : model->parameters()) r.param_bytes += static_cast<double>(t.numel() * t.element_size());
  r.optim_bytes = 2 * r.param_bytes;  // AdamW's exp_avg and exp_avg_sq, fp32 like the parameters
  auto ids = torch::randint(0, kVocab, {kB, kS}, torch::kLong);
  auto mask = torch::ones_like(ids);
  double total_s = 0;
  for (int s = 0; s < steps + 1; ++s) {
    tp.reset();
    const auto t0 = Clock::now();
    const double before = in_use_bytes();
    auto out = model->forward(ids, mask, ids);
    const double act = in_use_bytes() - before;
    const double fwd = tp.all_reduce_bytes / 2.0;
    backend.backward(out.loss, MicroStep{kB, true});
    const double bwd = tp.all_reduce_bytes / 2.0 - fwd;
    StepRequest req;
    req.lr = 1e-4;
    backend.step(req, s);
    if (s == 0) continue;  // warm-up
    total_s += seconds_since(t0);
    r.act_bytes = act, r.ar_bytes_fwd = fwd, r.ar_bytes_bwd = bwd;
  }
  r.ms_per_step = 1000 * total_s / steps;
  // The TP group's all-reduce bandwidth on this machine: 16 MB, payload bytes per second.
  auto buf = torch::ones({4 << 20});
  tp.all_reduce(buf);
  const auto t0 = Clock::now();
  for (int i = 0; i < 5; ++i) tp.all_reduce(buf);
  r.allreduce_gbps = p > 1 ? 5.0 * buf.numel() * 4 / seconds_since(t0) / 1e9 : 0.0;
  r.gemm = gemm_gflops();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 6;
  const double bsh = static_cast<double>(kB * kS * kH) * 4;  // bytes of one fp32 b*s*h tensor
  const double megatron = (4.0 * kLayers + 2.0) * bsh + 3.0 * kB * kS * 4;
  // Forward + backward FLOPs of the whole model per step (6 x matmul params x tokens + attention).
  const double matmul_params = kLayers * 12.0 * kH * kH + static_cast<double>(kVocab) * kH;
  const double flops = 6.0 * matmul_params * kB * kS + kLayers * 12.0 * kB * kS * kS * kH;
  std::vector<RankResult> by_p;
  for (int p : {1, 2, 4}) {
    const int port = free_port();
    const std::string file = "/tmp/bench_tp_" + std::to_string(::getpid()) + "_" + std::to_string(p);
    std::fflush(nullptr);
    std::vector<pid_t> pids;
    for (int rank = 0; rank < p; ++rank) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        RankResult r = run_rank(rank, p, port, steps);
        if (rank == 0) {
          std::ofstream(file) << r.param_bytes << " " << r.optim_bytes << " " << r.act_bytes << " " << r.ar_bytes_fwd
                              << " " << r.ar_bytes_bwd << " " << r.ms_per_step << " " << r.allreduce_gbps << " "
                              << r.gemm;
        }
        std::fflush(nullptr);
        ::_exit(0);
      }
      pids.push_back(pid);
    }
    for (auto pid : pids) {
      int st = 0;
      ::waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        std::fprintf(stderr, "tp %d: a rank failed\n", p);
        return 1;
      }
    }
    RankResult r;
    std::ifstream(file) >> r.param_bytes >> r.optim_bytes >> r.act_bytes >> r.ar_bytes_fwd >> r.ar_bytes_bwd >>
        r.ms_per_step >> r.allreduce_gbps >> r.gemm;
    std::remove(file.c_str());
    by_p.push_back(r);
  }
  const RankResult& one = by_p[0];
  std::printf("GPT-2 n_embd %lld, %lld layers, %lld heads, vocab %lld, batch %lld x %lld tokens, fp32, 1 thread per rank\n",
              (long long)kH, (long long)kLayers, (long long)kHeads, (long long)kVocab, (long long)kB, (long long)kS);
  std::printf("%-4s %14s %9s %14s %9s %16s %9s %22s %9s %10s %9s\n", "tp", "params+optim", "vs 1/p", "activations",
              "vs 1/p", "all-reduce/step", "Megatron", "comm at link speed", "ms/step", "vs tp 1", "GFLOP/s");
  int i = 0;
  for (int p : {1, 2, 4}) {
    const RankResult& r = by_p[i++];
    const double ar = r.ar_bytes_fwd + r.ar_bytes_bwd;
    const double expect = p > 1 ? megatron : 0.0;
    char comm[64] = "-";
    if (p > 1) std::snprintf(comm, sizeof comm, "%.1f ms at %.2f GB/s", 1000 * ar / (r.allreduce_gbps * 1e9), r.allreduce_gbps);
    std::printf("%-4d %11.1f MB %8.3fx %11.1f MB %8.3fx %13.2f MB %8.3fx %22s %9.1f %9.3fx %9.2f\n", p,
                (r.param_bytes + r.optim_bytes) / 1e6, (r.param_bytes + r.optim_bytes) / ((one.param_bytes + one.optim_bytes) / p),
                r.act_bytes / 1e6, r.act_bytes / (one.act_bytes / p), ar / 1e6, expect > 0 ? ar / expect : 0.0, comm,
                r.ms_per_step, r.ms_per_step / one.ms_per_step, flops / p / (r.ms_per_step / 1000) / 1e9);
  }
  std::printf("one-thread fp32 GEMM peak (512^3, measured in the TP 1 rank): %.2f GFLOP/s; GFLOP/s above = model FLOPs "
              "per rank per step / step time\n", one.gemm);
  std::printf("all-reduce/step = payload bytes in the TP group (fwd %.2f + bwd %.2f MB at TP 2); Megatron's count = "
              "(4 x layers + 2) x b*s*h + 3 x b*s fp32 = %.2f MB\n",
              by_p[1].ar_bytes_fwd / 1e6, by_p[1].ar_bytes_bwd / 1e6, megatron / 1e6);
  return 0;
}
