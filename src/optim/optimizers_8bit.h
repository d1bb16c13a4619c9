// Adam8bit, AdamW8bit and LAMB8bit (bitsandbytes' names) behind polytrain's Optimizer
// (optimizers.h): both moments kept block-wise quantized (blockwise_quant.h, 2 bytes + 8/256
// a parameter instead of 8), stepped by the fused kernels of cpu_optim_8bit.h. Also the 8-bit
// moments of one flat range as tensors (QuantizedMoments), which ZeRO's partition optimizer
// keeps per partition, and the bridge from a saved 8-bit state to fp32 moments that the
// universal checkpoint layout uses to hand an 8-bit checkpoint to any other optimizer or grid.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "polytrain/optim/cpu_optim_8bit.h"

namespace polytrain {

struct OptimizerConfig;
struct ParamGroup;
class Optimizer;

/// The 8-bit moments of a flat range of n elements, each tensor contiguous and CPU.
struct QuantizedMoments {
  at::Tensor exp_avg, exp_avg_sq;               ///< uint8 [n]: codes into the signed / unsigned code
  at::Tensor exp_avg_absmax, exp_avg_sq_absmax; ///< float [quant8::num_blocks(n)]

  /// Zero moments of n elements (every code the code's 0, every absmax 0).
  static QuantizedMoments zeros(int64_t n);
  bool defined() const { return exp_avg.defined(); }
  int64_t numel() const { return exp_avg.numel(); }
  /// Pointers for the kernels.
  optim8bit::StateView view();
  /// Bytes held: codes and absmax.
  int64_t bytes() const;
  /// "exp_avg" or "exp_avg_sq" dequantized into a new fp32 tensor [n].
  at::Tensor dequantized(const std::string& stat) const;
  /// Quantizes fp32 values (n elements, any shape) into "exp_avg" or "exp_avg_sq".
  void assign(const std::string& stat, const at::Tensor& values);
};

/// Adam8bit / AdamW8bit over whole parameters (fp32, CPU, contiguous: InputError naming
/// optimizer.type and the parameter otherwise). From cfg: lr, betas, eps, weight_decay per group,
/// bias_correction, adam_w_mode (forced on by the name AdamW8bit; Adam8bit follows it, decoupled
/// by default as DeepSpeed's Adam and bitsandbytes' Adam8bit); amsgrad is an InputError, as are
/// the values make_optimizer rejects. A step counter per parameter (as torch.optim's).
///
/// statistic("exp_avg" / "exp_avg_sq") returns a dequantized fp32 copy (the state is 8-bit):
/// writing it changes nothing; set_statistic requantizes a value into the state.
///
/// As bitsandbytes: a parameter with fewer than cfg.min_8bit_size elements, or whose name
/// contains one of cfg.keep_32bit_state (the embeddings by default), keeps fp32 moments and is
/// stepped by the fp32 optimizer's own code (cpu_adam::step; lamb_update), bit for bit.
///
/// save() keeps the 8-bit state: archive "names", and "s<i>" for each parameter that has state,
/// holding "step" (int), "exp_avg_codes" / "exp_avg_sq_codes" (uint8, the parameter's numel)
/// and "exp_avg_absmax" / "exp_avg_sq_absmax" (float, one per block of quant8::kBlockSize).
/// load() restores that exactly (a state saved with blocks of 2048, quant8::kLegacyBlockSize,
/// is dequantized with those and requantized), and also takes fp32 "exp_avg" / "exp_avg_sq"
/// (an AdamW, CPUAdam or Lamb checkpoint, or a universal checkpoint re-split for another grid),
/// quantizing them. A 32-bit
/// parameter saves "step", "exp_avg", "exp_avg_sq" as CPUAdam does, and dequantizes an 8-bit
/// saved state on load.
/// torch_optimizer() throws (no libtorch optimizer underneath).
std::unique_ptr<Optimizer> make_adam_8bit(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

/// LAMB8bit: polytrain's Lamb (lamb.h: clamp_value, bias_correction as `debias`, decoupled
/// weight decay inside the update) with 8-bit moments; otherwise as make_adam_8bit. Each step
/// makes two passes over each parameter (the trust ratio needs the update's norm first).
std::unique_ptr<Optimizer> make_lamb_8bit(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

namespace optim8bit {

/// The fp32 moments {"exp_avg", "exp_avg_sq"} (n elements each, flat) of a saved 8-bit state
/// (the tensors of one parameter's "s<i>" by key), or an empty map when `saved` holds no
/// 8-bit state. InputError naming `what` when its codes or scales do not fit n elements.
std::map<std::string, at::Tensor> dequantize_saved(const std::map<std::string, at::Tensor>& saved, int64_t n,
                                                   const std::string& what);

/// bitsandbytes' rule, as the 8-bit optimizers apply it: parameter `name` of `numel` elements
/// keeps fp32 moments when numel < cfg.min_8bit_size or its name contains one of
/// cfg.keep_32bit_state.
bool keeps_32bit_state(const OptimizerConfig& cfg, const std::string& name, int64_t numel);

/// Whether `key` is one of the 8-bit state's tensors in an archive ("exp_avg_codes", ...).
bool is_quantized_state_key(const std::string& key);

}  // namespace optim8bit

}  // namespace polytrain
