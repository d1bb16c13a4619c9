// Worker of bench/optim_8bit.sh: the 8-bit optimizer kernels (optim/cpu_optim_8bit.h) against
// the fp32 CPU Adam kernel (optim/cpu_adam.h) and against this machine's memory bandwidth.
//   bench_optim_8bit [params=N] [reps=R] [threads=T]
//     a STREAM triad (mem_bandwidth.h): the bandwidth B;
//     fp32: cpu_adam::step in AdamW mode over one flat range of N parameters: 28 bytes a
//           parameter (read p, g, m, v; write p, m, v);
//     8-bit: optim8bit::adam_step, AdamW mode, the same N: 16 bytes a parameter (read p, g and
//           two codes; write p and two codes) plus 16 bytes of block scales a block
//           (quant8::kBlockSize elements); with the kernel this CPU runs and with each lower
//           one forced;
//     LAMB8bit: optim8bit::lamb_step, two passes: 10 + 16 bytes a parameter;
//     then each one's seconds per step, bytes moved / seconds, that over B, and the ratios.
// N defaults to 32M (2^25). Each figure is the median of `reps` timed steps after two warm-up
// ones (the scalar kernel: 3 timed steps). T threads (default: the CPUs this process may run
// on), for the kernels and the triad alike. Output: one "key value" line per figure (the script
// reads them).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "polytrain/optim/blockwise_quant.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/cpu_optim_8bit.h"
#include "polytrain/optim/optimizers_8bit.h"
#include "mem_bandwidth.h"

namespace cpu_adam = polytrain::cpu_adam;
namespace optim8bit = polytrain::optim8bit;
using polytrain::bench::median_seconds;

namespace {

/// Seconds per fp32 CPU Adam step (AdamW mode, weight decay 0.01) over n parameters.
double time_fp32(int64_t n, int reps) {
  auto p = torch::randn({n}), g = torch::randn({n}) * 1e-3, m = torch::zeros({n}), v = torch::zeros({n});
  cpu_adam::Hyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.01f;
  int64_t step = 0;
  return median_seconds(reps, [&] {
    cpu_adam::step(h, ++step, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n);
  });
}

/// Seconds per 8-bit AdamW step (weight decay 0.01) over n parameters with kernel `isa`.
double time_adam8bit(int64_t n, int reps, cpu_adam::Isa isa) {
  auto p = torch::randn({n}), g = torch::randn({n}) * 1e-3;
  auto state = polytrain::QuantizedMoments::zeros(n);
  cpu_adam::Hyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.01f;
  int64_t step = 0;
  return median_seconds(reps, [&] {
    optim8bit::adam_step(h, ++step, p.data_ptr<float>(), g.data_ptr<float>(), state.view(), n, isa);
  });
}

/// Seconds per LAMB8bit step over one parameter of n elements.
double time_lamb8bit(int64_t n, int reps) {
  auto p = torch::randn({n}), g = torch::randn({n}) * 1e-3;
  auto state = polytrain::QuantizedMoments::zeros(n);
  std::vector<float> scratch(2 * polytrain::quant8::num_blocks(n));
  optim8bit::LambHyper h;
  h.weight_decay = 0.01;
  int64_t step = 0;
  return median_seconds(reps, [&] {
    optim8bit::lamb_step(h, ++step, p.data_ptr<float>(), g.data_ptr<float>(), state.view(), n, scratch.data());
  });
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{1} << 25;
  int reps = 9;
  int threads = polytrain::bench::cpus_available();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("params=", 0) == 0) n = std::stoll(a.substr(7));
    else if (a.rfind("reps=", 0) == 0) reps = std::stoi(a.substr(5));
    else if (a.rfind("threads=", 0) == 0) threads = std::max(1, std::stoi(a.substr(8)));
    else {
      std::fprintf(stderr, "usage: bench_optim_8bit [params=N] [reps=R] [threads=T]\n");
      return 2;
    }
  }
  at::set_num_threads(threads);
  const cpu_adam::Isa isa = cpu_adam::detect_isa();
  std::printf("threads %d\nparams %lld\nreps %d\nisa %s\n", threads, static_cast<long long>(n), reps,
              cpu_adam::isa_name(isa));
  const double blocks = static_cast<double>(polytrain::quant8::num_blocks(n));
  const double bytes_fp32 = 28.0 * n, bytes_8bit = 16.0 * n + 16.0 * blocks, bytes_lamb = 26.0 * n + 24.0 * blocks;
  std::printf("bytes_per_step_fp32 %.6g\nbytes_per_step_8bit %.6g\nbytes_per_step_lamb8bit %.6g\n", bytes_fp32,
              bytes_8bit, bytes_lamb);
  std::printf("state_bytes_fp32 %.6g\nstate_bytes_8bit %.6g\n", 8.0 * n, 2.0 * n + 8.0 * blocks);
  std::fflush(stdout);

  const polytrain::bench::Triad triad = polytrain::bench::measure_triad(threads, reps);
  std::printf("triad_plain_bytes_per_s %.4g\ntriad_stream_bytes_per_s %.4g\n", triad.plain_bytes_per_s,
              triad.stream_bytes_per_s);
  std::fflush(stdout);
  const double fp32 = time_fp32(n, reps);
  std::printf("fp32_adamw_s %.5g\n", fp32);
  std::fflush(stdout);
  const double q8 = time_adam8bit(n, reps, isa);
  std::printf("adamw8bit_s %.5g\n", q8);
  std::fflush(stdout);
  for (cpu_adam::Isa lower : {cpu_adam::Isa::kAvx2, cpu_adam::Isa::kScalar}) {
    if (static_cast<int>(lower) >= static_cast<int>(isa)) continue;
    std::printf("adamw8bit_%s_s %.5g\n", cpu_adam::isa_name(lower),
                time_adam8bit(n, lower == cpu_adam::Isa::kScalar ? 3 : reps, lower));
    std::fflush(stdout);
  }
  const double lamb = time_lamb8bit(n, reps);
  std::printf("lamb8bit_s %.5g\n", lamb);
  std::printf("ratio_fp32_over_8bit %.3f\n", fp32 / q8);
  std::printf("bandwidth_fraction_fp32 %.3f\nbandwidth_fraction_8bit %.3f\nbandwidth_fraction_lamb8bit %.3f\n",
              bytes_fp32 / fp32 / triad.best(), bytes_8bit / q8 / triad.best(), bytes_lamb / lamb / triad.best());
  return 0;
}
