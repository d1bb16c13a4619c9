// Where a GPU training step's time goes (issue 15, bench/gpu_step.sh): the step of
// bench_gpu_step (gpu_step_setup.h) under LibTorch's Kineto profiler for STEPS steps. Prints
// the wall time per step, the GPU's busy time (the union of its kernel and copy intervals),
// the idle rest (launch gaps and host syncs), the busy time by kind of kernel (matmul,
// attention, elementwise, LayerNorm, softmax / cross-entropy, reductions, optimizer, copies,
// other) and the 12 kernels that take longest. gpu_step_torch.py's "profile" mode prints the
// same table for the Python eager step.
// Usage: bench_gpu_profile MODEL SWITCHES BATCH SEQ STEPS [DEC_SEQ]   (as bench_gpu_step)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "gpu_step_setup.h"
#include "kineto_times.h"

using namespace polytrain;
using namespace polytrain::bench;
namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string kind_of(const std::string& name) {
  const std::string n = lower(name);
  auto has = [&](const char* k) { return n.find(k) != std::string::npos; };
  if (has("memcpy") || has("memset")) return "copies";
  if (has("flash") || has("fmha") || has("attention")) return "attention";
  if (has("multi_tensor_apply") || has("adam")) return "optimizer (multi-tensor)";
  if (has("gemm") || has("gemv") || has("nvjet") || has("cutlass") || has("xmma") || has("cublas") || has("sm90_"))
    return "matmul";
  if (has("layer_norm") || has("layernorm")) return "layernorm";
  if (has("softmax") || has("xent") || has("nll") || has("cross_entropy") || has("scatter") || has("gather")) return "softmax / CE";
  if (has("reduce")) return "reductions";
  if (has("elementwise") || has("vectorized") || has("unrolled")) return "elementwise";
  return "other";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: bench_gpu_profile MODEL SWITCHES BATCH SEQ STEPS [DEC_SEQ]\n");
    return 2;
  }
  const std::string model_name = argv[1], switches = argv[2];
  const int64_t seq = std::stoll(argv[4]);
  const int steps = std::stoi(argv[5]);
  const int64_t dec_seq = argc > 6 ? std::stoll(argv[6]) : std::max<int64_t>(1, seq / 4);
  GpuStep g = make_gpu_step(model_name, switches, seq, dec_seq);
  const int64_t batch = g.fit(split_list(argv[3]));
  if (batch == 0) {
    std::printf("no_batch_fits 1\n");
    return 1;
  }
  for (int i = 0; i < 2; ++i) g.step(batch);
  device_sync(g.device);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (g.device.is_cuda()) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) g.step(batch);
  device_sync(g.device);
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto result = prof::disableProfiler();

  std::vector<std::pair<uint64_t, uint64_t>> spans;  // device intervals [start, end) ns
  std::map<std::string, double> by_kind, by_kernel;
  for (const auto& e : result->events()) {
    if (e.deviceType() == c10::DeviceType::CPU) continue;
    const uint64_t s = start_ns(e, 0), d = duration_ns(e, 0);
    spans.emplace_back(s, s + d);
    by_kind[kind_of(e.name())] += d / 1e6;
    by_kernel[e.name()] += d / 1e6;
  }
  std::sort(spans.begin(), spans.end());
  double busy_ms = 0;
  uint64_t cur_s = 0, cur_e = 0;
  for (const auto& [s, e] : spans) {
    if (s > cur_e) {
      busy_ms += (cur_e - cur_s) / 1e6;
      cur_s = s, cur_e = e;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  busy_ms += (cur_e - cur_s) / 1e6;
  std::printf("model %s\nswitches %s\nbatch %lld\nsteps %d\n", model_name.c_str(), switches.c_str(),
              static_cast<long long>(batch), steps);
  std::printf("wall_ms_per_step %.2f\ngpu_busy_ms_per_step %.2f\ngpu_idle_ms_per_step %.2f\n", wall_ms / steps,
              busy_ms / steps, (wall_ms - busy_ms) / steps);
  std::vector<std::pair<double, std::string>> kinds, kernels;
  for (const auto& [k, ms] : by_kind) kinds.emplace_back(ms, k);
  for (const auto& [k, ms] : by_kernel) kernels.emplace_back(ms, k);
  std::sort(kinds.rbegin(), kinds.rend());
  std::sort(kernels.rbegin(), kernels.rend());
  for (const auto& [ms, k] : kinds) std::printf("kind %-26s %9.2f ms/step\n", k.c_str(), ms / steps);
  for (size_t i = 0; i < kernels.size() && i < 12; ++i)
    std::printf("kernel %9.2f ms/step  %.110s\n", kernels[i].first / steps, kernels[i].second.c_str());
  return 0;
}
