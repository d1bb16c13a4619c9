// A ZeRO checkpoint without the run: its optimizer shards (any number of ranks) put back
// together per parameter, with every element accounted for exactly once (DeepSpeed's
// zero_to_fp32 miscounted padding, #1317, and dropped layers, #1896: here a gap or an overlap
// is an error naming the parameter). Used by the zero_to_fp32 tool and the tests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain {

class ShardReader;

struct ZeroParamState {
  std::vector<int64_t> shape;
  at::Tensor master, exp_avg, exp_avg_sq;  ///< fp32, the parameter's shape
};

struct ZeroConsolidated {
  int64_t step = 0;
  int64_t shards = 0;    ///< shard files read
  int64_t elements = 0;  ///< parameter elements restored (padding excluded)
  std::vector<std::pair<std::string, ZeroParamState>> params;  ///< in the order first seen
};

/// One saved slice of a parameter: elements [begin, begin + length) of `name` (of `shape`),
/// with its master weights and moments (length elements each, fp32, CPU).
struct ZeroPiece {
  const std::string& name;
  const std::vector<int64_t>& shape;
  int64_t numel = 0;
  int64_t begin = 0;
  int64_t length = 0;
  at::Tensor master, exp_avg, exp_avg_sq;
  const std::string& origin;  ///< the shard file, for messages
};

/// Visits every piece of every shard of a checkpoint saved by env_type deepspeed, checking the
/// shard format, the ranges and that all shards agree on the step; returns the step.
/// InputError naming the file on anything malformed, or when there is no shard.
int64_t for_each_zero_piece(const ShardReader& reader, const std::function<void(const ZeroPiece&)>& visit);

/// Reads every shard_<r>.pt of a checkpoint saved by env_type deepspeed. InputError naming the
/// file and parameter on anything that does not add up.
ZeroConsolidated consolidate_zero_shards(const ShardReader& reader);

}  // namespace polytrain
