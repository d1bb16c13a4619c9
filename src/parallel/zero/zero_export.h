// A checkpoint's optimizer state without the run: its shards (any number of ranks, any grid)
// put back together per parameter, with every element accounted for exactly once (DeepSpeed's
// zero_to_fp32 miscounted padding, #1317, and dropped layers, #1896: here a gap or an overlap
// is an error naming the parameter). Used by the zero_to_fp32 tool and the tests.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain {

class ShardReader;

struct ZeroParamState {
  std::vector<int64_t> shape;
  at::Tensor master, exp_avg, exp_avg_sq;  ///< fp32, the parameter's whole shape (undefined: not saved)
};

struct ZeroConsolidated {
  int64_t step = 0;
  int64_t shards = 0;    ///< shard files read
  int64_t elements = 0;  ///< parameter elements restored (padding excluded)
  std::vector<std::pair<std::string, ZeroParamState>> params;  ///< in the order first seen
};

/// Reads every shard_<r>.pt of a checkpoint in the universal layout (any env_type, grid and
/// ZeRO stage; universal_state.h). `master` is undefined for a parameter whose optimizer kept
/// no fp32 copy apart from the model (the model file holds its weights). InputError naming the
/// file and parameter on anything that does not add up.
ZeroConsolidated consolidate_zero_shards(const ShardReader& reader);

}  // namespace polytrain
