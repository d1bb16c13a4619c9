// DeepSpeed's CPU Adam (DeepSpeedCPUAdam, csrc/includes/cpu_adam.h) for polytrain: one fused
// pass over fp32 master weights, gradients and both moments per step, vectorised with AVX-512
// or AVX2+FMA (picked at run time from cpuid, so one build runs on any x86-64 CPU), optionally
// writing the updated weights as bf16 / fp16 in the same pass (ZeRO offload copies those to the
// model's half-precision parameters). Memory bandwidth is the limit: 28 bytes per parameter
// (read p, g, m, v; write p, m, v), where libtorch's AdamW makes a dozen passes and allocates
// temporaries the size of the parameter every step.
//
// Two ways in: cpu_adam::step, the raw kernel over flat float arrays (what ZeRO's partition
// optimizer calls), and make_cpu_adam, the kernel behind polytrain's Optimizer interface for
// whole CPU parameters, with state saved in the same archive layout as libtorch's AdamW.
// This header stays free of torch headers: include polytrain/optim/optimizers.h to use the
// Optimizer that make_cpu_adam returns.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace polytrain::cpu_adam {

/// Instruction sets with a kernel, in increasing order.
enum class Isa { kScalar, kAvx2, kAvx512 };

/// The best kernel this CPU and OS can run: cpuid says the instructions exist (AVX2 with FMA
/// and F16C; AVX-512 F, DQ and BW) and xgetbv says the OS saves the ymm / zmm registers. Never
/// derived from build flags. Always kScalar off x86-64.
Isa hardware_isa();

/// hardware_isa(), lowered by the environment variable POLYTRAIN_CPU_ADAM_ISA = scalar | avx2 |
/// avx512 when it names a lower one (a test hook; a higher one is ignored). InputError for any
/// other value. Reads the variable on every call (cheap), the cpuid result once. The 8-bit
/// optimizers' kernels (cpu_optim_8bit.h) dispatch by it too.
Isa detect_isa();

/// "scalar", "avx2", "avx512".
const char* isa_name(Isa isa);

/// What step() also writes: nothing, or the updated weights as bf16 / fp16 bits.
enum class CopyOut { kNone, kBf16, kFp16 };

/// Hyperparameters of one step. adam_w_mode: decoupled decay (AdamW) when true, L2 decay added
/// to the gradient (classic Adam) when false. bias_correction=false drops both corrections.
struct Hyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  bool adam_w_mode = true;
  bool bias_correction = true;
};

/// One Adam step over n elements, in place on `param` (fp32 master weights), `exp_avg` (m) and
/// `exp_avg_sq` (v) from `grad`. `step` is the 1-based count of this update (incremented
/// before the call). With bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (both 1 without bias
/// correction), in double and then cast to float, per element:
///   g = grad (+ weight_decay * param when !adam_w_mode)
///   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
///   param -= lr * weight_decay * param                   (adam_w_mode)
///   param -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
/// With copy != kNone it also writes the updated param into `out` (n uint16 bits) as bf16,
/// bit-identical to c10::BFloat16(float) (round to nearest even, any NaN -> 0x7FC0), or as
/// fp16, bit-identical to c10::Half(float) (round to nearest even, NaN -> sign | 0x7E00).
/// Each element is computed the same way wherever it falls (SIMD body, tail, thread chunk), so
/// the result does not depend on the thread count. Runs on at::get_num_threads() threads
/// (chunks of at least 32K elements; serial inside a parallel region) and allocates nothing
/// once its worker threads exist. `isa` above hardware_isa() is an InternalError.
void step(const Hyper& h, int64_t step, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
          int64_t n, CopyOut copy = CopyOut::kNone, uint16_t* out = nullptr, Isa isa = detect_isa());

}  // namespace polytrain::cpu_adam

namespace polytrain {

struct OptimizerConfig;
struct ParamGroup;
class Optimizer;

/// DeepSpeed's CPU Adam behind polytrain's Optimizer (optimizers.h), over whole parameters:
/// fp32, CPU, contiguous (InputError naming the parameter otherwise), each group with its own
/// weight decay. From cfg: lr, betas, eps, bias_correction, adam_w_mode (forced on when
/// cfg.type is "AdamW"); amsgrad is an InputError (DeepSpeed's CPU Adam has none), as are
/// values make_optimizer rejects (negative lr / eps / weight decay, betas outside [0, 1)).
/// One step counter for the whole optimizer, counting every step() (a parameter without a
/// gradient is left alone but still sees the shared count afterwards, as in ZeRO). State is
/// saved by parameter name exactly as make_optimizer's AdamW saves it (archive "names", and
/// "s<i>" holding AdamWParamState's "step", "exp_avg", "exp_avg_sq"), so checkpoints move
/// between the two; load takes the largest saved "step" as the counter. torch_optimizer()
/// throws (there is no libtorch optimizer underneath).
std::unique_ptr<Optimizer> make_cpu_adam(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

}  // namespace polytrain
