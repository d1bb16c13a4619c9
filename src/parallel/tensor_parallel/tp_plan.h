// Applying a model's tensor-parallel plan (models/tp_layers.h): which weights are split along
// which dim, the in-place split of the whole model every rank built, and the reverse (slice a
// whole tensor, assemble the parts) that checkpoints, --init_from and --save_hf use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "polytrain/models/tp_layers.h"

namespace polytrain {

class Communicator;

/// How one parameter is split: along `dim`, in `blocks` equal blocks each split p ways
/// (column), or padded to a multiple of p rows first (vocab).
struct TpShardSpec {
  int64_t dim = 0;
  int64_t blocks = 1;
  bool vocab = false;  ///< rows padded to a multiple of p (Megatron's make_vocab_size_divisible_by)
  int64_t whole = 0;   ///< the whole (unpadded) size along dim
};

/// Rank `rank` of `size`'s part of `whole` (a copy, contiguous; vocab padding rows are zeros).
at::Tensor tp_slice(const at::Tensor& whole, const TpShardSpec& spec, int64_t rank, int64_t size);
/// The whole tensor from every rank's part (rank order); the inverse of tp_slice.
at::Tensor tp_assemble(const std::vector<at::Tensor>& parts, const TpShardSpec& spec);

/// The split of one model over a tensor-parallel group.
class TpSharding {
 public:
  /// Checks the plan's divisibility, then splits `model` (the whole model, identical on every
  /// rank) in place: narrowed weights, TpSlots set, region dropouts drawing from `generator`.
  /// InputError naming the key or module and the numbers when a size does not divide.
  TpSharding(torch::nn::Module& model, const TpPlan& plan, std::shared_ptr<TensorParallelRegion> region,
             const at::Generator& generator);

  bool is_sharded(const std::string& param) const { return specs_.count(param) > 0; }
  const std::map<std::string, TpShardSpec>& specs() const { return specs_; }
  /// This rank's part of a whole parameter (InputError naming `origin` on a wrong shape).
  at::Tensor slice(const std::string& param, const at::Tensor& whole, const std::string& origin) const;
  /// The whole parameter from this rank's `part` (collective over the tensor-parallel group).
  at::Tensor gather(const std::string& param, const at::Tensor& part, Communicator& group) const;
  /// Puts the whole model back in place (collective): every split parameter gathered, every
  /// layer a plain one again.
  void unshard(torch::nn::Module& model, Communicator& group);

 private:
  int64_t rank_ = 0, size_ = 1;
  std::map<std::string, TpShardSpec> specs_;
  std::map<std::string, std::vector<int64_t>> whole_shapes_;
};

}  // namespace polytrain
