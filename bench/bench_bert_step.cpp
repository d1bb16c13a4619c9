// C++ side of bench/bert_step.sh: per-step time (forward + backward + clip + AdamW) of
// polytrain's BertForMaskedLM on a fixed random batch, the same model, batch and threads as
// bert_step_torch.py. Usage: bench_bert_step tiny|base STEPS THREADS [MODE [profile|profile_shapes]] (THREADS 0:
// polytrain's default, all the CPUs this process may use); bench_bert_step gemm 0 THREADS:
// this machine's fp32 GEMM rate (gpt2_matmuls: over GPT-2 124M's matmuls); bench_bert_step peaks 0 THREADS: the CPU, the BLAS kernel, the
// fp32 and bf16 GEMM rates and the cores' fp32 FMA and AMX bf16 peaks (bench/gemm_peak.h).
// bench_bert_step cpu 0 0: the CPU and BLAS lines the benchmark scripts print beside their figures.
// MODE: default (the model's defaults, what train_bert runs: the MLM head only at masked
//       positions and the fused LM loss, no [tokens, vocab] logits),
//       fused (fused LM loss, head at every position),
//       dense (head everywhere, logits materialised + cross_entropy: the Python side's kernels),
//       checkpoint (default + activation checkpointing of every encoder layer),
//       bf16 (default under CPU autocast in bf16, as bf16.enabled runs it: fp32 master weights).
// All give the same loss and gradients to float rounding. Also prints the threads, the matmul
// FLOPs the mode runs per step (forward + backward = 3x forward) and the process's peak
// resident memory (getrusage), for bench/activation_memory.sh. profile: the timed steps under
// LibTorch's profiler, each op's self time (profile_shapes: per input shapes and dtypes).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include "gemm_peak.h"
#include "kineto_times.h"
#include "polytrain/common/autocast.h"
#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/config.h"
#include "polytrain/common/cpu_budget.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/cpu_dropout.h"
#include "polytrain/ops/cpu_gemm.h"
#include "polytrain/parallel/update.h"
#include "polytrain/optim/optimizers.h"

using namespace polytrain;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: bench_bert_step tiny|base|gemm STEPS THREADS [default|fused|dense|checkpoint|bf16]\n");
    return 2;
  }
  const std::string size = argv[1];
  const int steps = std::stoi(argv[2]);
  at::set_num_threads(std::stoi(argv[3]) > 0 ? std::stoi(argv[3]) : default_thread_count(0));
  std::printf("threads %d\n", at::get_num_threads());
  if (size == "gemm") {
    std::printf("gemm_gflops %.1f\n", bench::gemm_gflops());
    return 0;
  }
  if (size == "gpt2_matmuls") {  // bench/blas_kernels.sh: the engine's rate on GPT-2 124M's matmuls
    std::printf("gemm_gflops %.1f\n", bench::gpt2_matmul_gflops());
    return 0;
  }
  if (size == "cpu" || size == "peaks") {  // what the benchmark scripts print beside their figures
    std::printf("cpu %s | %s\n", describe_cpu(host_cpu_features()).c_str(), host_cpu_features().model_name.c_str());
    std::printf("blas %s [kernel %s]\n", blas_description().c_str(), blas_kernel_note().c_str());
    const auto e = cpu_gemm::engine();
    std::printf("gemm_engine %s\n", e == cpu_gemm::Engine::kOneDnn ? "onednn" : e == cpu_gemm::Engine::kBlas ? "blas" : "aten");
  }
  if (size == "cpu") return 0;
  if (size == "peaks") {  // bench/blas_kernels.sh: GEMM rates against the cores' arithmetic peaks
    const int t = at::get_num_threads();
    const auto [fp32_peak, isa] = bench::fp32_peak_gflops(t);
    std::printf("fp32_gemm_gflops %.1f\n", bench::gemm_gflops());
    std::printf("fp32_peak_gflops %.1f (%s)\n", fp32_peak, isa.c_str());
    std::printf("bf16_gemm_gflops %.1f\n", bench::gemm_gflops(1024, 5, 8, at::kBFloat16));
    std::printf("amx_bf16_peak_gflops %.1f\n", bench::amx_bf16_peak_gflops(t));
    return 0;
  }
  if (size == "dropout") {  // polytrain's CPU dropout against ATen's, forward + backward, BERT-base shapes
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      for (auto shape : {std::vector<int64_t>{8, 128, 768}, std::vector<int64_t>{8, 12, 128, 128}}) {
        auto x = torch::randn(shape).to(dtype).requires_grad_(true);
        auto time = [&](const std::function<at::Tensor(const at::Tensor&)>& f) {
          double best = 1e30;
          for (int r = 0; r < steps; ++r) {
            auto t0 = std::chrono::steady_clock::now();
            f(x).backward(torch::ones_like(x));
            best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          }
          return best;
        };
        const double aten = time([](const at::Tensor& t) { return torch::dropout(t, 0.1, true); });
        const double ours = time([](const at::Tensor& t) { return cpu_dropout(t, 0.1); });
        std::printf("dropout %s %s fwd+bwd: aten %.2f ms, polytrain %.2f ms (%.1fx), %.2f GB/s\n",
                    c10::toString(dtype), c10::str(x.sizes()).c_str(), aten, ours, aten / ours,
                    4.0 * x.numel() * x.element_size() / ours / 1e6);
      }
    }
    return 0;
  }
  const std::string mode = argc > 4 ? argv[4] : "default";
  torch::manual_seed(0);
  ModelConfig mc;
  int64_t batch = 32;
  if (size == "tiny") {
    mc.hidden_size = 128, mc.num_hidden_layers = 2, mc.num_attention_heads = 2, mc.intermediate_size = 512;
  } else {
    batch = 8;
  }
  if (const char* d = std::getenv("BENCH_DROPOUT")) mc.hidden_dropout_prob = mc.attention_probs_dropout_prob = std::atof(d);
  BertForMaskedLM model(mc);
  if (mode == "fused" || mode == "dense") model->score_masked_only_ = false;
  if (mode == "dense") model->fused_lm_loss_ = false;
  model->set_activation_checkpointing(mode == "checkpoint");
  OptimizerConfig oc;
  oc.type = "AdamW";
  oc.lr = 1e-4;
  oc.weight_decay = 0.01;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  std::vector<at::Tensor> params;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value()), params.push_back(p.value());
  auto opt = make_torch_optimizer(oc, named);
  auto ids = torch::randint(1000, mc.vocab_size, {batch, 128}, torch::kLong);
  auto labels = torch::where(torch::rand({batch, 128}) < 0.15, ids, torch::full_like(ids, -100));
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  auto step = [&] {
    std::optional<AutocastGuard> autocast;
    if (mode == "bf16") autocast.emplace(c10::DeviceType::CPU, c10::kBFloat16);
    auto out = model->forward(ids, am, tt, labels);
    autocast.reset();
    out.loss.backward();
    clip_grads(params, grad_norm(params), 1.0);
    opt->step();
    opt->zero_grad();
  };
  step();
  namespace prof = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  const std::string profile_arg = argc > 5 ? argv[5] : "";
  const bool profile = profile_arg == "profile" || profile_arg == "profile_shapes";
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/profile_arg == "profile_shapes");
  if (profile) {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  if (profile) bench::print_self_times(prof::disableProfiler()->events(), steps, profile_arg == "profile_shapes");
  std::printf("ms_per_step %s %.2f\n", size.c_str(), ms);
  // Matmul FLOPs of a dense step: per token and layer 8h^2 (Q, K, V, O) + 4hI (FFN) + 4sh
  // (scores, context); the head 2h^2 + 2hV per scored token; backward twice the forward.
  const double h = mc.hidden_size, I = mc.intermediate_size, V = mc.vocab_size, s = 128, tokens = batch * s;
  const double scored = model->score_masked_only_ ? labels.ne(-100).sum().item<double>() : tokens;
  const double fwd = tokens * mc.num_hidden_layers * (8 * h * h + 4 * h * I + 4 * s * h) + scored * (2 * h * h + 2 * h * V);
  std::printf("gflop_per_step %.2f\n", 3 * fwd / 1e9);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("peak_rss_mb %.1f\n", ru.ru_maxrss / 1024.0);
  return 0;
}
