// ZeRO stages 0, 1, 2, 3 (at DeepSpeed's defaults, and with a live window of 5.5e7 parameters
// and no reuse) and 3 + offload (offload_param and offload_optimizer) on GPT-2 124M
// (n_embd 768, 12 layers, vocab 50257) at 4 CPU ranks (forked processes, Gloo on loopback, one
// thread each), side by side in one run. Per stage, rank 0's:
//   - parameter bytes held between steps (the backend's own buffers) against ZeRO's formula
//     (4 Psi whole at stages 0-2, 4 Psi / Nd at stage 3 plus the persistent parameters), and
//     stage 3's live window: the most bytes of gathered layers at once during a step;
//   - the whole process's resident set between steps (after the first step, the allocator's
//     free memory handed back to the system) and its peak during the later steps (the kernel's
//     high-water mark, reset then: /proc/self/clear_refs), which add the libraries, activations,
//     gradients in flight and the allocator's slack to the backend's buffers;
//   - ms per step (the mean of the steps after the first) and stage 3's ratio to stage 2;
//   - bytes gathered and reduced per step by a counting wrapper around the communicator,
//     against Psi (stage 3's goal: 3 Psi, DeepSpeed's 1.5x of data parallelism's 2 Psi).
// Usage: bench_zero3 [STEPS]   (default 4; micro-batch 1 x 128 tokens per rank)
#include <dlfcn.h>
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
#include "polytrain/parallel/zero/zero_backend.h"
#include "../tests/helpers/free_port.h"  // a port the kernel says is free

using namespace polytrain;
using polytrain::testing::free_port;

namespace {

constexpr int kWorld = 4;

Gpt2Config model_config() {
  Gpt2Config c;  // GPT-2 124M
  c.vocab_size = 50257, c.n_positions = 1024, c.n_embd = 768, c.n_layer = 12, c.n_head = 12;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
  return c;
}

struct Variant {
  const char* label;
  int stage;
  bool offload;
  nlohmann::json coordinator = nlohmann::json::object();  ///< stage 3's prefetch / reuse / live keys
};

struct Row {
  double params = 0, gathered_peak = 0, moments = 0, grads = 0, host = 0, rss = 0, ms = 0, gather = 0, reduce = 0,
         psi = 0, loss = 0, floor = 0;
};

// Free memory back to the system: gperftools' tcmalloc when it is the allocator, else glibc's.
void release_free_memory() {
  using Release = void (*)();
  if (auto f = reinterpret_cast<Release>(::dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory"))) f();
  else ::malloc_trim(0);
}

// The kernel's high-water mark of this process's resident set, in bytes (VmHWM).
double status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::string(key).size())) * 1024.0;
  return 0.0;
}

Row run_rank(int rank, int port, const Variant& v, int steps) {
  at::set_num_threads(1);
  // Buckets of 5 M elements (20 MB) at every stage; overlap_comm as DeepSpeed's default (on at stage 3 only).
  nlohmann::json z = {{"stage", v.stage}, {"reduce_bucket_size", 5000000}, {"allgather_bucket_size", 5000000}};
  z.update(v.coordinator);
  if (v.offload) {
    z["offload_optimizer"] = {{"device", "cpu"}};
    if (v.stage == 3) z["offload_param"] = {{"device", "cpu"}};
  }
  nlohmann::json doc = {{"train_batch_size", kWorld},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}},
                        {"zero_optimization", z},
                        {"trainer", {{"env_type", "deepspeed"}, {"seed", 1}}}};
  Config cfg = config_from_json(doc, "bench", kWorld);
  auto counting = std::make_unique<CountingCommunicator>(
      make_gloo_communicator(rank, kWorld, "127.0.0.1", port, std::chrono::seconds(600)));
  CountingCommunicator* c = counting.get();
  ZeroBackend zero(cfg, std::move(counting));
  torch::manual_seed(1);
  auto model = Gpt2LMHeadModel(model_config()).ptr();
  Row r;
  for (const auto& p : model->parameters()) r.psi += static_cast<double>(p.numel());
  zero.prepare(model, cfg);
  auto gen = at::detail::createCPUGenerator(100 + rank);
  struct Runner : MicroBatchRunner {
    Gpt2LMHeadModelImpl* m;
    at::Generator gen;
    double loss = 0;
    at::Tensor forward(int64_t) override {
      auto ids = torch::randint(0, 50257, {1, 128}, gen, torch::kLong);
      auto out = m->forward(ids, torch::ones_like(ids), ids);
      loss = out.loss.item<double>();
      return out.loss;
    }
  } runner;
  runner.m = model.get();
  runner.gen = gen;
  double total_ms = 0;
  for (int s = 0; s < steps; ++s) {
    c->reset();
    const auto t0 = std::chrono::steady_clock::now();
    zero.run_micro_batches(runner);
    StepRequest req;
    req.lr = 1e-4;
    zero.step(req, s);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) total_ms += ms;
    if (s == 0) {  // the steady state's peak from here on
      release_free_memory();
      r.floor = status_bytes("VmRSS:");
      std::ofstream("/proc/self/clear_refs") << "5";
    }
  }
  r.ms = total_ms / std::max(1, steps - 1);
  r.gather = static_cast<double>(c->gather_bytes);
  r.reduce = static_cast<double>(c->reduce_bytes);
  r.loss = runner.loss;
  const ZeroMemory m = zero.memory();
  r.params = static_cast<double>(m.params);
  r.gathered_peak = static_cast<double>(m.gathered_params_peak);
  r.moments = static_cast<double>(m.optimizer_state);
  r.grads = static_cast<double>(m.gradients);
  r.host = static_cast<double>(m.host_copies + m.master);
  r.rss = status_bytes("VmHWM:");
  return r;
}

Row run_all(const Variant& v, int steps) {
  const int port = free_port();
  const std::string base = "/tmp/bench_zero3_" + std::to_string(::getpid()) + "_";
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < kWorld; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int rc = 0;
      try {
        const Row r = run_rank(rank, port, v, steps);
        std::ofstream(base + std::to_string(rank)) << r.params << " " << r.gathered_peak << " " << r.moments << " "
                                                   << r.grads << " " << r.host << " " << r.rss << " " << r.ms << " "
                                                   << r.gather << " " << r.reduce << " " << r.psi << " " << r.loss << " " << r.floor;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        rc = 1;
      }
      std::fflush(nullptr);
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (auto pid : pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  if (!ok) {
    std::fprintf(stderr, "%s: a rank failed\n", v.label);
    std::exit(1);
  }
  Row r;  // rank 0's figures
  for (int rank = kWorld - 1; rank >= 0; --rank) {
    const std::string f = base + std::to_string(rank);
    std::ifstream(f) >> r.params >> r.gathered_peak >> r.moments >> r.grads >> r.host >> r.rss >> r.ms >> r.gather >>
        r.reduce >> r.psi >> r.loss >> r.floor;
    std::remove(f.c_str());
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 4;
  // Stage 3 at DeepSpeed's defaults (prefetch 5e7 elements, reuse distance and live parameters
  // 1e9: every block kept from its forward to its backward), and with a live window of the
  // embeddings + 2 blocks (5.5e7) and no reuse (each block gathered for its forward and again
  // for its backward, the next one prefetched while room is left).
  const nlohmann::json window = {{"stage3_max_live_parameters", 55000000}, {"stage3_max_reuse_distance", 0}};
  const std::vector<Variant> variants = {{"stage 0", 0, false},
                                         {"stage 1", 1, false},
                                         {"stage 2", 2, false},
                                         {"stage 3", 3, false},
                                         {"stage 3 live 5.5e7", 3, false, window},
                                         {"stage 3 + offload", 3, true}};
  std::printf("GPT-2 124M (n_embd 768, 12 layers), fp32, env_type deepspeed at %d CPU ranks (1 thread each, Gloo on "
              "loopback), micro-batch 1 x 128 tokens per rank, %d steps (the first left out of the time); rank 0:\n",
              kWorld, steps);
  std::printf("%-18s %10s %9s %12s %11s %10s %10s %9s %9s %11s %11s %11s %9s\n", "", "params MB", "formula", "live win MB",
              "moments MB", "grads MB", "host MB", "RSS MB", "peak MB", "ms/step", "gather/Psi", "reduce/Psi", "loss");
  double stage2_ms = 0, stage3_ms = 0, psi = 0;
  for (const auto& v : variants) {
    const Row r = run_all(v, steps);
    psi = r.psi;
    // ZeRO's parameter bytes between steps: whole at stages 0-2, the partition at stage 3 (the
    // persistent parameters, biases and norms below 1e5 elements, stay whole: ~0.1 M here).
    const double formula = v.stage == 3 ? 4 * r.psi / kWorld : 4 * r.psi;
    std::printf("%-18s %10.1f %8.3fx %12.1f %11.1f %10.1f %10.1f %9.1f %9.1f %11.1f %11.3f %11.3f %9.4f\n", v.label,
                r.params / 1e6, r.params / formula, r.gathered_peak / 1e6, r.moments / 1e6, r.grads / 1e6, r.host / 1e6,
                r.floor / 1e6, r.rss / 1e6, r.ms, r.gather / (4 * r.psi), r.reduce / (4 * r.psi), r.loss);
    std::fflush(stdout);
    if (v.stage == 2) stage2_ms = r.ms;
    if (v.stage == 3 && !v.offload && v.coordinator.empty()) stage3_ms = r.ms;
  }
  std::printf("Psi = %.2f M parameters. formula: 4 Psi (stages 0-2) or 4 Psi / %d (stage 3); live win: the most bytes of "
              "gathered units at once (the embeddings and head for the whole step, plus the running blocks); "
              "RSS: the process's resident set between steps (free memory handed back), peak: its high-water mark "
              "during the steps after the first; gather/Psi and reduce/Psi: bytes this rank moved per step over 4 Psi.\n",
              psi / 1e6, kWorld);
  std::printf("stage 3 step time / stage 2: %.3fx (goal <= 1.25x)\n", stage3_ms / stage2_ms);
  return 0;
}
