// Pipeline schedules side by side in one run (forked ranks, Gloo on loopback, one thread each),
// against the bubble theory and the hardware:
//   A. GPT-2 (n_embd 256, 8 layers, vocab 512, 4 x 128 tokens per micro-batch, M = 8 micro-batches)
//      cut into P = 2 balanced stages (partition type:Gpt2Block): per stage the measured idle
//      fraction of the schedule (1 - forward and backward time / step time) for 1F1B, interleaved
//      1F1B (V = 2) and GPipe, against theory (P - 1) / (V M + P - 1); the step time against one
//      process running the whole model (the ideal is 1 / (P (1 - bubble)) of it); stage 0's peak
//      activation memory (heap in use above the step's start, glibc mallinfo2) for 1F1B against
//      GPipe, and the same at P = 4 (4 processes on this machine's cores: memory only).
//   B. The same schedules (and ZB-H1) at P = 4 on layers that sleep a fixed time (forward 4 ms,
//      backward 8 ms per stage and micro-batch, half for the input gradient and half for the
//      weight's), so the machine's core count does not shape the timeline: the engine's own
//      schedule and communication against theory (ZB-H1: the replay of its lists).
//   C. The hardware limit of the links: loopback point-to-point bandwidth between two ranks
//      (64 MiB messages), and the activation bytes a stage sends per step in A.
// Usage: bench_pipeline [STEPS]   (default 3 measured steps after one warm-up step)
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/pipeline/pipeline_stage.h"
#include "polytrain/parallel/pipeline/pp_schedule.h"
#include "../tests/helpers/free_port.h"  // a port the kernel says is free
#include "../tests/helpers/rank_process.h"

using namespace polytrain;
using polytrain::testing::free_port;
using polytrain::testing::run_as_rank;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kMicro = 8;   // micro-batches per step
constexpr int64_t kBatch = 4;   // samples per micro-batch
constexpr int64_t kSeq = 128;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Forks `world` ranks running body(rank) -> JSON, each written to a file; returns them by rank.
template <class F>
std::vector<json> run_forked(int world, F body) {
  const std::string base = "/tmp/bench_pipeline_" + std::to_string(::getpid()) + "_";
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) run_as_rank(r, [&](int rank) {
        std::ofstream(base + std::to_string(rank)) << body(rank).dump();
        return 0;
      });
    pids.push_back(pid);
  }
  std::vector<json> out;
  for (int r = 0; r < world; ++r) {
    int st = 0;
    ::waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::fprintf(stderr, "rank %d failed\n", r);
      std::exit(1);
    }
    std::ifstream in(base + std::to_string(r));
    json j;
    in >> j;
    out.push_back(j);
    std::remove((base + std::to_string(r)).c_str());
  }
  return out;
}

Gpt2Config model_config() {
  Gpt2Config c;
  c.vocab_size = 512, c.n_positions = kSeq, c.n_embd = 256, c.n_layer = 8, c.n_head = 8;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
  return c;
}

std::map<std::string, at::Tensor> tokens(int64_t m) {
  auto gen = at::detail::createCPUGenerator(11 + static_cast<uint64_t>(m));
  at::Tensor ids = torch::randint(0, 512, {kBatch, kSeq}, gen, torch::kLong);
  return {{"input_ids", ids}, {"labels", ids}};
}

struct Runner : MicroBatchRunner {
  int64_t next = 0;
  std::function<std::map<std::string, at::Tensor>(int64_t)> make;
  at::Tensor forward(int64_t) override { throw std::runtime_error("not used"); }
  std::map<std::string, at::Tensor> read(int64_t) override { return make(next++); }
  at::Tensor weigh(const at::Tensor& loss, int64_t) override { return loss / static_cast<double>(kMicro); }
};

Config pipeline_config(int world, const std::string& schedule, int64_t virtual_stages, const std::string& partition) {
  json doc = {{"train_micro_batch_size_per_gpu", kBatch},
              {"gradient_accumulation_steps", kMicro},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}},
              {"trainer", {{"env_type", "pytorchDDP"}, {"pipeline_parallel_size", world}, {"comm_timeout", 120}}},
              {"pipeline", {{"schedule", schedule}, {"virtual_stages", virtual_stages}, {"partition", partition}}}};
  return config_from_json(doc, "bench", world);
}

// One configuration's ranks: `steps` measured steps after a warm-up; per stage the mean idle
// fraction, step seconds, peak in flight and peak activation bytes.
json run_stage(int rank, int world, int port, const std::string& schedule, int64_t V, int steps,
               const std::function<std::shared_ptr<torch::nn::Module>()>& make_model, const std::string& partition,
               const std::function<std::map<std::string, at::Tensor>(int64_t)>& inputs) {
  Config cfg = pipeline_config(world, schedule, V, partition);
  auto comm = make_gloo_communicator(rank, world, "127.0.0.1", port, std::chrono::seconds(120));
  DdpBackend backend(cfg, std::move(comm));
  auto model = make_model();
  backend.prepare(model, cfg);
  double idle = 0, step_s = 0, compute_s = 0, weight_s = 0;
  int64_t peak_bytes = 0, in_flight = 0, split = 0;
  for (int k = 0; k <= steps; ++k) {
    Runner runner;
    runner.make = inputs;
    backend.run_micro_batches(runner);
    backend.step(StepRequest{1e-4}, k);
    const PipelineStepStats& s = backend.pipeline()->stats();
    if (k == 0) continue;  // warm-up
    idle += 1.0 - s.compute_s / s.step_s;
    step_s += s.step_s;
    compute_s += s.compute_s;
    weight_s += s.weight_s;
    split = s.split_backwards;
    peak_bytes = std::max(peak_bytes, s.peak_activation_bytes);
    in_flight = std::max(in_flight, s.peak_in_flight);
  }
  return {{"idle", idle / steps}, {"step_s", step_s / steps}, {"compute_s", compute_s / steps},
          {"peak_bytes", peak_bytes}, {"in_flight", in_flight}, {"describe", backend.pipeline()->describe()},
          {"weight_s", weight_s / steps}, {"split", split}};
}

// A layer x * w that takes a fixed time: sleeps `fwd` in forward, and in backward half of `bwd`
// for the input's gradient and half for the weight's (ZB-H1's B and W ask for one each).
struct Sleep : torch::autograd::Function<Sleep> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double fwd,
                            double bwd) {
    ctx->saved_data["bwd"] = bwd;
    ctx->save_for_backward({x, w});
    std::this_thread::sleep_for(std::chrono::duration<double>(fwd));
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const double half = ctx->saved_data["bwd"].toDouble() / 2;
    const auto saved = ctx->get_saved_variables();
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      std::this_thread::sleep_for(std::chrono::duration<double>(half));
      gx = g[0] * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      std::this_thread::sleep_for(std::chrono::duration<double>(half));
      gw = g[0] * saved[0];
    }
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

// Layers that each take `fwd` / `bwd` seconds (one parameter each so they have a gradient).
struct SleepStack : torch::nn::Module, PipelinePlanned {
  SleepStack(int64_t n, double fwd, double bwd) : fwd_(fwd), bwd_(bwd) {
    for (int64_t i = 0; i < n; ++i) w.push_back(register_parameter("w" + std::to_string(i), torch::ones({64})));
  }
  PipelinePlan pipeline_plan() override {
    PipelinePlan plan;
    for (size_t i = 0; i < w.size(); ++i) {
      PipeLayer l;
      l.name = "w" + std::to_string(i);
      l.type = "Sleep";
      l.params = {l.name};
      const bool last = i + 1 == w.size();
      at::Tensor p = w[i];
      const double f = fwd_, b = bwd_;
      l.run = [p, i, last, f, b](const TensorMap& in, TensorMap& carry) {
        at::Tensor h = i == 0 ? in.at("x") : carry.at("h");
        h = Sleep::apply(h, p, f, b);
        if (last) {
          carry.clear();
          carry["loss"] = h.sum();
        } else {
          carry["h"] = h;
        }
      };
      plan.layers.push_back(std::move(l));
    }
    return plan;
  }
  std::vector<at::Tensor> w;
  double fwd_, bwd_;
};

// The idle fraction theory gives: (P - 1) / (V M + P - 1) for 1F1B, GPipe and interleaving; for
// ZB-H1 the replay of its lists with this stage's forward and backward times (its paper's bubble,
// (P - 1)(F + B - W), needs the W passes' share).
double bubble(const std::string& schedule, int64_t P, int64_t V, double fwd, double bwd) {
  if (schedule != "zbh1") return theoretical_bubble(P, V, kMicro);
  return simulate_schedule("zbh1", P, 1, kMicro, fwd, bwd).idle_fraction.front();
}

void print_row(const char* what, const std::string& schedule, int64_t P, int64_t V, const std::vector<json>& ranks,
               double one_process_s) {
  const double theory = bubble(schedule, P, V, 1.0, 2.0);
  std::printf("  %-12s P %ld V %ld  theory %.3f | idle per stage:", schedule.c_str(), static_cast<long>(P),
              static_cast<long>(V), theory);
  for (const auto& r : ranks) std::printf(" %.3f", r["idle"].get<double>());
  const double step = ranks[0]["step_s"].get<double>();
  std::printf(" | step %.1f ms", 1e3 * step);
  if (one_process_s > 0)
    std::printf(" (one process %.1f ms: speedup %.2fx, ideal %.2fx)", 1e3 * one_process_s, one_process_s / step,
                static_cast<double>(P) * (1.0 - theory));
  std::printf(" | stage 0 in flight %ld, activations %.1f MB\n", static_cast<long>(ranks[0]["in_flight"].get<int64_t>()),
              ranks[0]["peak_bytes"].get<int64_t>() / 1e6);
  (void)what;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 3;
  torch::manual_seed(0);
  std::printf("bench_pipeline: %ld micro-batches per step, %d measured steps\n", static_cast<long>(kMicro), steps);

  // A. GPT-2, real compute. One process first: the whole model, M micro-batches, forward + backward.
  auto gpt2 = [] {
    torch::manual_seed(0);
    return Gpt2LMHeadModel(model_config()).ptr();
  };
  const json one = run_forked(1, [&](int) {
    auto model = gpt2();
    auto* planned = dynamic_cast<PipelinePlanned*>(model.get());
    const PipelinePlan plan = planned->pipeline_plan();
    double total = 0;
    for (int k = 0; k <= steps; ++k) {
      const auto t0 = Clock::now();
      for (int64_t m = 0; m < kMicro; ++m) (run_pipeline_plan(plan, tokens(m)) / static_cast<double>(kMicro)).backward();
      model->zero_grad();
      if (k > 0) total += seconds_since(t0);
    }
    // The GEMM peak of this thread, for the distance of the step to the machine: a 1024^3 fp32
    // product, best of 5.
    at::Tensor a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
    double best = 1e9;
    for (int k = 0; k < 5; ++k) {
      const auto t0 = Clock::now();
      at::Tensor c = at::mm(a, b);
      best = std::min(best, seconds_since(t0));
    }
    return json{{"step_s", total / steps}, {"gemm_gflops", 2.0 * 1024 * 1024 * 1024 / best / 1e9}};
  })[0];
  const double one_s = one["step_s"].get<double>();
  // Training FLOPs of a step: 6 x tokens x the matmul parameters (blocks and the LM head), plus
  // attention's scores and context (forward 4 L d per token and layer, backward twice that).
  const Gpt2Config mc = model_config();
  const double tokens_per_step = static_cast<double>(kMicro * kBatch * kSeq);
  const double matmul_params = static_cast<double>(mc.n_layer * 12 * mc.n_embd * mc.n_embd + mc.vocab_size * mc.n_embd);
  const double flops = tokens_per_step * (6 * matmul_params + 12.0 * mc.n_layer * kSeq * mc.n_embd);
  std::printf("A. GPT-2 (n_embd 256, 8 layers, vocab 512), %ld x %ld tokens per micro-batch; one process %.1f ms per step "
              "= %.1f GFLOP/s, against this thread's fp32 GEMM peak %.1f GFLOP/s (1024^3)\n",
              static_cast<long>(kBatch), static_cast<long>(kSeq), 1e3 * one_s, flops / one_s / 1e9,
              one["gemm_gflops"].get<double>());
  int64_t act_bytes_1f1b = 0, act_bytes_gpipe = 0;
  for (auto [schedule, V] : {std::pair<std::string, int64_t>{"1f1b", 1}, {"1f1b", 2}, {"gpipe", 1}, {"zbh1", 1}}) {
    const int port = free_port();
    auto ranks = run_forked(2, [&](int rank) {
      return run_stage(rank, 2, port, schedule, V, steps, gpt2, "type:Gpt2Block", tokens);
    });
    if (V == 1) std::printf("  stages: %s | %s\n", ranks[0]["describe"].get<std::string>().c_str(),
                            ranks[1]["describe"].get<std::string>().c_str());
    print_row("A", V > 1 ? "interleaved" : schedule, 2, V, ranks, one_s);
    if (schedule == "zbh1")
      std::printf("    W passes %.1f ms of %.1f ms compute on stage 1; split backwards per step %ld\n",
                  1e3 * ranks[1]["weight_s"].get<double>(), 1e3 * ranks[1]["compute_s"].get<double>(),
                  static_cast<long>(ranks[1]["split"].get<int64_t>()));
    if (V == 1 && schedule == "1f1b") act_bytes_1f1b = ranks[0]["peak_bytes"].get<int64_t>();
    if (schedule == "gpipe") act_bytes_gpipe = ranks[0]["peak_bytes"].get<int64_t>();
  }
  std::printf("  stage 0 peak activations at M = %ld, P = 2: 1F1B %.1f MB, GPipe %.1f MB (%.2fx; theory %ld / %ld "
              "micro-batches)\n",
              static_cast<long>(kMicro), act_bytes_1f1b / 1e6, act_bytes_gpipe / 1e6,
              static_cast<double>(act_bytes_gpipe) / static_cast<double>(std::max<int64_t>(act_bytes_1f1b, 1)),
              static_cast<long>(kMicro), 2L);
  int64_t p4[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const std::string schedule = i == 0 ? "1f1b" : "gpipe";
    const int port = free_port();
    auto ranks = run_forked(4, [&](int rank) { return run_stage(rank, 4, port, schedule, 1, 1, gpt2, "type:Gpt2Block", tokens); });
    p4[i] = ranks[0]["peak_bytes"].get<int64_t>();
  }
  std::printf("  stage 0 peak activations at M = %ld, P = 4 (memory only): 1F1B %.1f MB, GPipe %.1f MB (%.2fx; theory "
              "%ld / 4 micro-batches)\n",
              static_cast<long>(kMicro), p4[0] / 1e6, p4[1] / 1e6,
              static_cast<double>(p4[1]) / static_cast<double>(std::max<int64_t>(p4[0], 1)), static_cast<long>(kMicro));

  // B. P = 4 on layers of fixed duration: 8 layers, 2 per stage (1 per chunk when interleaved).
  const double fwd = 0.004, bwd = 0.008;
  std::printf("B. P = 4, layers of fixed duration (forward %.0f ms, backward %.0f ms per stage and micro-batch)\n",
              1e3 * fwd, 1e3 * bwd);
  auto sleepy = [&] { return std::make_shared<SleepStack>(8, fwd / 2, bwd / 2); };
  // The input needs a gradient too, so the first stage's backward costs what the others' do.
  auto x = [](int64_t) { return std::map<std::string, at::Tensor>{{"x", torch::ones({64}).requires_grad_(true)}}; };
  for (auto [schedule, V] : {std::pair<std::string, int64_t>{"1f1b", 1}, {"1f1b", 2}, {"gpipe", 1}, {"zbh1", 1}}) {
    const int port = free_port();
    auto ranks = run_forked(4, [&](int rank) { return run_stage(rank, 4, port, schedule, V, steps, sleepy, "uniform", x); });
    const double ideal = static_cast<double>(kMicro) * (fwd + bwd) / (1.0 - bubble(schedule, 4, V, fwd, bwd));
    print_row("B", V > 1 ? "interleaved" : schedule, 4, V, ranks, 0);
    std::printf("    step %.1f ms against the schedule's own %.1f ms (the replay's step at these layer times)\n",
                1e3 * ranks[0]["step_s"].get<double>(), 1e3 * ideal);
  }

  // C. The link: loopback point-to-point bandwidth, and what a stage sends per step in A.
  const int port = free_port();
  const json link = run_forked(2, [&](int rank) {
    auto comm = make_gloo_communicator(rank, 2, "127.0.0.1", port, std::chrono::seconds(60));
    at::Tensor t = torch::ones({16 * 1024 * 1024});  // 64 MiB
    double best = 1e9;
    for (int k = 0; k < 4; ++k) {
      comm->barrier();
      const auto t0 = Clock::now();
      if (rank == 0) comm->send(t, 1, k);
      else comm->recv(t, 0, k);
      if (k > 0) best = std::min(best, seconds_since(t0));
    }
    // Latency: a 4-byte ping-pong, best of 50 round trips.
    at::Tensor tiny = torch::zeros({1});
    double rtt = 1e9;
    for (int k = 0; k < 50; ++k) {
      const auto t0 = Clock::now();
      if (rank == 0) {
        comm->send(tiny, 1, 100);
        comm->recv(tiny, 1, 101);
      } else {
        comm->recv(tiny, 0, 100);
        comm->send(tiny, 0, 101);
      }
      rtt = std::min(rtt, seconds_since(t0));
    }
    return json{{"s", best}, {"rtt", rtt}};
  })[0];
  const double gbs = 64.0 * 1024 * 1024 / link["s"].get<double>() / 1e9;
  std::printf("C. loopback point-to-point round trip of 4 bytes: %.0f us (a transfer of the schedule is 2-3 messages)\n",
              1e6 * link["rtt"].get<double>());
  const double per_step = 2.0 * kMicro * kBatch * kSeq * 256 * 4;  // activations forward + gradients back, fp32
  std::printf("   loopback point-to-point: %.2f GB/s; a stage boundary moves %.1f MB per step in A (%.1f ms at that "
              "rate, against %.1f ms per step of one process)\n",
              gbs, per_step / 1e6, 1e3 * per_step / (gbs * 1e9), 1e3 * one_s);
  return 0;
}
