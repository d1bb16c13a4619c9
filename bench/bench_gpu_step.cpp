// C++ side of bench/gpu_step.sh (issue 15): one training step (forward, backward, gradient
// norm + clip at 1.0, AdamW, gradients set to none) of GPT-2 124M, BERT-base or T5-small on
// random tokens, dropout off, as polytrain's pytorch backend runs it (models, apply_update,
// make_optimizer). gpu_step_torch.py runs the same models in Python PyTorch (eager and
// torch.compile).
//
// Usage: bench_gpu_step MODEL SWITCHES BATCHES SEQ STEPS [DEC_SEQ]
//   MODEL     gpt2 | bert | t5 (124M / base / small), or gpt2-tiny | bert-tiny | t5-tiny (CPU checks)
//   SWITCHES  "fast" = bf16,sdpa,tf32,fused; "exact" = none (fp32, eager attention, full-fp32
//             matmuls, libtorch's per-parameter AdamW); or a comma list of bf16, sdpa, tf32,
//             fused, foreach, dense (BERT: the LM head at every position, as HF computes it)
//   BATCHES   micro-batch sizes, largest first ("32,24,16"): the first that fits is timed
//   SEQ       tokens per sample (T5: encoder tokens); DEC_SEQ: T5's decoder tokens (default SEQ/4)
//   STEPS     timed steps, after 3 warm-up steps
// Prints "key value" lines: batch, ms_per_step, tokens_per_s, model_flops_per_step, mfu (of
// 989.4 TFLOP/s, the H100 SXM's dense bf16 peak), peak_mem_gb, syncs_per_step (CUDA's
// synchronizing calls counted by its sync-debug mode), and a per-phase split (forward,
// backward, update: from 3 extra steps with a device sync between phases).
#include <chrono>
#include <cstdio>
#include <string>

#include "gpu_step_setup.h"

using namespace polytrain;
using namespace polytrain::bench;

namespace {

#ifdef POLYTRAIN_WITH_CUDA
// Counts the warnings CUDA's sync-debug mode raises (one per synchronizing call).
struct SyncCounter : c10::WarningHandler {
  int64_t count = 0;
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
};
#endif

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: bench_gpu_step gpt2|bert|t5[-tiny] fast|exact|SWITCHES BATCHES SEQ STEPS [DEC_SEQ]\n");
    return 2;
  }
  const std::string model_name = argv[1], switches = argv[2];
  const auto batches = split_list(argv[3]);
  const int64_t seq = std::stoll(argv[4]);
  const int steps = std::stoi(argv[5]);
  const int64_t dec_seq = argc > 6 ? std::stoll(argv[6]) : std::max<int64_t>(1, seq / 4);
  GpuStep g = make_gpu_step(model_name, switches, seq, dec_seq);
  const c10::Device device = g.device;
  const int64_t batch = g.fit(batches);
  if (batch == 0) {
    std::printf("no_batch_fits 1\n");
    return 1;
  }
  for (int i = 0; i < 2; ++i) g.step(batch);
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  device_sync(device);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) g.step(batch);
  device_sync(device);
  const double ms = ms_since(t0) / steps;

  // Phases, with a device sync after each (3 steps).
  double f_ms = 0, b_ms = 0, u_ms = 0, loss_sum = 0;
  for (int i = 0; i < 3; ++i) {
    auto t = std::chrono::steady_clock::now();
    auto loss = g.forward(batch);
    device_sync(device);
    f_ms += ms_since(t), t = std::chrono::steady_clock::now();
    loss.backward();
    device_sync(device);
    b_ms += ms_since(t), t = std::chrono::steady_clock::now();
    apply_update(g.params, *g.opt, g.uo, {}, nullptr);
    g.clear();
    device_sync(device);
    u_ms += ms_since(t);
    loss_sum += loss.item<double>();
  }
  // Synchronizing calls in 2 steps.
  double syncs = -1;
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    SyncCounter counter;
    auto* previous = c10::WarningUtils::get_warning_handler();
    c10::WarningUtils::set_warning_handler(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    for (int i = 0; i < 2; ++i) g.step(batch);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous);
    syncs = counter.count / 2.0;
  }
#endif
  const double tokens = static_cast<double>(batch * g.tokens_per_sample);
  std::printf("model %s\nswitches %s\ndevice %s\nparams %lld\nbatch %lld\nseq %lld\n", model_name.c_str(),
              switches.c_str(), device.str().c_str(), static_cast<long long>(g.n_params), static_cast<long long>(batch),
              static_cast<long long>(seq));
  std::printf("ms_per_step %.2f\ntokens_per_s %.0f\n", ms, 1000.0 * tokens / ms);
  std::printf("model_flops_per_step %.4e\nmfu %.4f\n", g.flops(batch), g.flops(batch) / (ms / 1000.0) / kPeakBf16);
  std::printf("forward_ms %.2f\nbackward_ms %.2f\nupdate_ms %.2f\n", f_ms / 3, b_ms / 3, u_ms / 3);
  std::printf("syncs_per_step %.1f\n", syncs);
  std::printf("loss %.4f\n", loss_sum / 3);
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    std::printf("peak_mem_gb %.2f\n", stats.allocated_bytes[0].peak / 1e9);  // [0]: the aggregate over pools
  }
#endif
  return 0;
}
