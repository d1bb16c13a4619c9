// C++ side of bench/gpt2_step.sh: GPT-2 forward + backward tokens/s (no optimizer step) of
// polytrain's Gpt2LMHeadModel on a fixed random batch; gpt2_step_torch.py runs the same model,
// batch and threads in Python PyTorch. Dropout is off on both sides (the reference has none).
// Usage: bench_gpt2_step small|tiny STEPS THREADS BATCH SEQ [default|dense|checkpoint|bf16|attention]
//        [profile|profile_shapes]
// MODE: default (fused LM loss: no [tokens, vocab] logits), dense (logits + cross_entropy, the
// Python side's kernels), checkpoint (default + every block recomputed in backward), bf16
// (default under CPU autocast in bf16, as bf16.enabled runs it: fp32 master weights), attention
// (one layer's attention alone, eager against the fused kernel, STEPS rounds; no model step).
// PROFILE ("profile"): the timed steps under LibTorch's profiler; prints each op's self time;
// "profile_shapes": per op, input shapes and dtypes (which GEMM, which cast).
// THREADS 0: polytrain's default (all the CPUs this process may use).
// Prints the threads, ms_per_step, tokens_per_s, the step's matmul FLOPs (forward + backward)
// and the process's peak resident memory.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/cpu_budget.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/ops/cpu_ops.h"
#include "kineto_times.h"

using namespace polytrain;
using bench::duration_ns;
using bench::print_self_times;
using bench::start_ns;
namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

namespace {

// Mode "attention": one layer's causal attention forward + backward, from the QKV projection's
// output to the context, the eager ops (what attn_implementation eager runs) against
// cpu_ops::causal_attention (what auto runs), alternated, best of `reps` each, dropout off.
int attention_side_by_side(const Gpt2Config& c, int64_t batch, int64_t seq, int reps) {
  const int64_t heads = c.n_head, e = c.n_embd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(e / heads));
  auto qkv = torch::randn({batch, seq, 3 * e}).requires_grad_(true);
  auto g = torch::randn({batch, seq, e});
  auto future = torch::ones({seq, seq}, torch::kBool).triu(1).view({1, 1, seq, seq});
  auto eager = [&] {
    auto parts = qkv.split(e, 2);
    auto split = [&](const at::Tensor& t) { return t.view({batch, seq, heads, -1}).transpose(1, 2); };
    auto scores = torch::matmul(split(parts[0]), split(parts[1]).transpose(-1, -2)) * scale;
    auto probs = torch::softmax(scores.masked_fill(future, std::numeric_limits<float>::lowest()), -1);
    return torch::matmul(probs, split(parts[2])).transpose(1, 2).reshape({batch, seq, -1});
  };
  double best[2] = {1e30, 1e30};
  for (int r = 0; r <= reps; ++r)
    for (int side = 0; side < 2; ++side) {
      const auto t0 = std::chrono::steady_clock::now();
      auto out = side == 0 ? eager() : cpu_ops::causal_attention(qkv, heads, scale, 0.0, 0);
      out.backward(g);
      qkv.mutable_grad() = at::Tensor();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best[side] = std::min(best[side], ms);  // the first round warms up
    }
  std::printf("attention [%lld, %lld, %lld heads], forward + backward, best of %d\n", static_cast<long long>(batch),
              static_cast<long long>(seq), static_cast<long long>(heads), reps);
  std::printf("eager_ms %.2f\nfused_ms %.2f\nspeedup %.2f\n", best[0], best[1], best[0] / best[1]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr,
                 "usage: bench_gpt2_step small|tiny STEPS THREADS BATCH SEQ [default|dense|checkpoint|bf16|attention] [profile]\n");
    return 2;
  }
  const std::string size = argv[1];
  const int steps = std::stoi(argv[2]);
  at::set_num_threads(std::stoi(argv[3]) > 0 ? std::stoi(argv[3]) : default_thread_count(0));
  std::printf("threads %d\n", at::get_num_threads());
  const int64_t batch = std::stoll(argv[4]), seq = std::stoll(argv[5]);
  const std::string mode = argc > 6 ? argv[6] : "default";
  const std::string profile_arg = argc > 7 ? argv[7] : "";
  const bool profile = profile_arg == "profile" || profile_arg == "profile_shapes";
  const bool shapes = profile_arg == "profile_shapes";
  torch::manual_seed(0);
  Gpt2Config c;  // GPT-2 small (124M) by default
  if (size == "tiny") c.n_embd = 128, c.n_layer = 2, c.n_head = 2;
  if (mode == "attention") return attention_side_by_side(c, batch, seq, steps);
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
  c.fused_lm_loss = mode != "dense";
  Gpt2LMHeadModel model(c);
  model->train();
  model->set_activation_checkpointing(mode == "checkpoint");
  auto ids = torch::randint(0, c.vocab_size, {batch, seq}, torch::kLong);
  auto step = [&] {
    std::optional<AutocastGuard> autocast;
    if (mode == "bf16") autocast.emplace(c10::DeviceType::CPU, c10::kBFloat16);
    auto loss = model->forward(ids, {}, ids).loss;
    autocast.reset();
    loss.backward();
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();  // set_to_none, as torch's default
  };
  step();
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/shapes);
  if (profile) {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  if (profile) print_self_times(prof::disableProfiler()->events(), steps, shapes);
  std::printf("ms_per_step %.1f\ntokens_per_s %.1f\n", ms, 1000.0 * batch * seq / ms);
  // Matmul FLOPs: per token and layer 8h^2 (QKV, proj) + 16h^2 (MLP, 4h) + 4 * seq * h
  // (causal scores and context computed in full), the tied head 2hV; backward twice the forward.
  const double h = c.n_embd, V = c.vocab_size, tokens = static_cast<double>(batch * seq);
  const double fwd = tokens * (c.n_layer * (24 * h * h + 4.0 * seq * h) + 2 * h * V);
  std::printf("gflop_per_step %.2f\n", 3 * fwd / 1e9);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("peak_rss_mb %.1f\n", ru.ru_maxrss / 1024.0);
  return 0;
}
