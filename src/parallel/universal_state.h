// The universal layout of optimizer state in a checkpoint: every backend writes the same thing,
// so any checkpoint loads on any grid (env_type, TP size, DP size, ZeRO stage), with no offline
// conversion (DeepSpeed's ds_to_universal.py is a separate step; here it is the format).
//
// Each shard_<r>.pt holds "universal_format" = 1 and the pieces this rank owned. A piece is a
// range of one logical parameter's state, named by the parameter's full name and whole shape:
//   split:  which tensor-parallel part it is a range of (rank `part` of `parts`, split along
//           `dim` as the TP plan splits it: `blocks` equal blocks, or padded vocab rows), or
//           the whole parameter (parts == 1);
//   range:  [begin, begin + length) of that part, flattened (a ZeRO partition boundary may cut
//           a parameter anywhere);
//   step:   the parameter's optimizer step count;
//   stats:  the state tensors by torch.optim's names ("exp_avg", "exp_avg_sq", "momentum_buffer",
//           "sum", ...) and "master" (ZeRO's fp32 master weights), `length` elements each;
//   blobs:  the piece's other state tensors, kept with their dtype and size: an 8-bit
//           optimizer's codes and block scales (optimizers_8bit.h), which only mean something
//           for the whole part they were saved from.
// Reading puts every parameter back together whole and checks that the pieces cover each part
// exactly once: a gap or an overlap is an error naming the parameter. An 8-bit state (blobs of
// every part, no fp32 moments) is also dequantized into "exp_avg" / "exp_avg_sq", so that any
// optimizer on any grid can load it; the blobs themselves go back only to the same part.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "polytrain/common/torch_fwd.h"

namespace polytrain {

class ShardReader;
struct TpShardSpec;

/// Where a piece's part sits in the whole parameter (parts == 1: the whole parameter).
struct StateSplit {
  int64_t dim = 0;
  int64_t blocks = 1;
  bool vocab = false;
  int64_t part = 0;
  int64_t parts = 1;
};

struct StatePiece {
  std::string name;
  std::vector<int64_t> whole_shape;
  StateSplit split;
  int64_t begin = 0;
  int64_t length = 0;
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> stats;  ///< `length` elements each (any float dtype)
  std::vector<std::pair<std::string, at::Tensor>> blobs;  ///< any size and dtype; whole parts only
};

/// The split of a tensor-parallel part of `whole_shape` by `spec` (rank `part` of `parts`).
StateSplit state_split(const TpShardSpec& spec, int64_t part, int64_t parts);

/// Writes the pieces into a shard's archive.
void write_state_pieces(torch::serialize::OutputArchive& archive, const std::vector<StatePiece>& pieces);

/// One parameter's state, whole.
struct ParamState {
  std::vector<int64_t> shape;
  int64_t step = 0;
  std::map<std::string, at::Tensor> stats;  ///< fp32, CPU, the parameter's whole shape
  int64_t saved_parts = 1;                  ///< the TP parts it was saved in
  /// Per saved TP part that one piece covered whole: its blobs, as saved.
  std::map<int64_t, std::map<std::string, at::Tensor>> blobs;
  /// `stat` of this rank's part (the whole tensor when spec is null), flattened.
  at::Tensor local(const std::string& stat, const TpShardSpec* spec, int64_t rank, int64_t size) const;
};

struct UniversalState {
  std::vector<std::pair<std::string, ParamState>> params;  ///< in the order first seen
  int64_t shards = 0;    ///< shard files read
  int64_t elements = 0;  ///< parameter elements restored
  int64_t step = 0;      ///< the largest step of any parameter
  const ParamState* find(const std::string& name) const;
};

/// Whether the checkpoint's shards are in the universal layout (or the ZeRO layout it grew
/// from, zero_format 1, which reads the same way).
bool has_universal_state(const ShardReader& reader);

/// Every shard of the checkpoint read and put together. InputError naming the file and the
/// parameter on a malformed piece, a shape that differs between pieces, a gap or an overlap.
UniversalState read_universal_state(const ShardReader& reader);

/// The optimizer archive `save` writes (names + s<i>, optimizers.h) as pieces of whole
/// parameters, each where `layout` says it sits.
/// Used by the backends whose optimizer is a whole-parameter one (libtorch's, CPU Adam, Lamb).
class Optimizer;
struct PieceLayout {
  std::vector<int64_t> whole_shape;  ///< the logical parameter's
  std::vector<int64_t> local_shape;  ///< this rank's part's
  StateSplit split;
};
std::vector<StatePiece> optimizer_pieces(const Optimizer& opt, const std::map<std::string, PieceLayout>& layout);
/// Loads `state` into a whole-parameter optimizer: each parameter's statistics sliced to this
/// rank's part (`spec_of(name)`: its TP split or null), and its blobs where they were saved from
/// this same part (the same TP split). "master" is left out (the model file holds the weights).
/// InputError naming the parameter when the checkpoint has no state for it.
void load_optimizer_state(Optimizer& opt, const UniversalState& state,
                          const std::map<std::string, const TpShardSpec*>& specs, int64_t tp_rank, int64_t tp_size,
                          const std::string& origin);

}  // namespace polytrain
