// consolidate_zero_shards: the universal reader's parameters in the shape zero_to_fp32 and the
// tests use.
#include "polytrain/parallel/zero/zero_export.h"

#include "polytrain/parallel/universal_state.h"
#include "polytrain/checkpoint/checkpoint.h"

namespace polytrain {

ZeroConsolidated consolidate_zero_shards(const ShardReader& reader) {
  const UniversalState state = read_universal_state(reader);
  ZeroConsolidated out;
  out.step = state.step;
  out.shards = state.shards;
  out.elements = state.elements;
  for (const auto& [name, ps] : state.params) {
    ZeroParamState p;
    p.shape = ps.shape;
    auto get = [&](const char* stat) {
      auto it = ps.stats.find(stat);
      return it == ps.stats.end() ? at::Tensor() : it->second;
    };
    p.master = get("master");
    p.exp_avg = get("exp_avg");
    p.exp_avg_sq = get("exp_avg_sq");
    out.params.emplace_back(name, std::move(p));
  }
  return out;
}

}  // namespace polytrain
