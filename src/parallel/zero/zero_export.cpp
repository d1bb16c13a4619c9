// consolidate_zero_shards: every piece of every shard into its parameter, counted.
#include "polytrain/parallel/zero/zero_export.h"

#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/trainer/checkpoint.h"

namespace polytrain {

using detail::cat;

int64_t for_each_zero_piece(const ShardReader& reader, const std::function<void(const ZeroPiece&)>& visit) {
  PT_INPUT_CHECK(reader.env_type() == "deepspeed" || reader.env_type() == "deepspeed+mpu", reader.origin(),
                 ": optimizer state saved by env_type '", reader.env_type(), "', not deepspeed: it is not ZeRO-sharded");
  std::optional<int64_t> step;
  for (int64_t s = 0; s < reader.saved_world_size(); ++s) {
    if (!reader.has_shard(s)) continue;
    reader.read_shard(s, [&](torch::serialize::InputArchive& a, const std::string& origin) {
      c10::IValue format, pieces_iv;
      PT_INPUT_CHECK(a.try_read("zero_format", format) && format.isInt() && format.toInt() == 1, origin,
                     ": not a ZeRO optimizer shard (no zero_format 1)");
      at::Tensor step_t, master, m, v;
      a.read("step", step_t);
      a.read("pieces", pieces_iv);
      a.read("master", master);
      a.read("exp_avg", m);
      a.read("exp_avg_sq", v);
      PT_INPUT_CHECK(step_t.numel() == 1, origin, ": 'step' must hold one value");
      const int64_t this_step = step_t.item<int64_t>();
      PT_INPUT_CHECK(!step || *step == this_step, origin, ": step ", this_step, " differs from another shard's ", *step);
      step = this_step;
      nlohmann::json pieces;
      try {
        pieces = nlohmann::json::parse(pieces_iv.toStringRef());
      } catch (const std::exception& e) {
        throw InputError(cat(origin, ": unreadable 'pieces': ", e.what()));
      }
      const int64_t n = master.numel();
      PT_INPUT_CHECK(master.dim() == 1 && m.numel() == n && v.numel() == n, origin,
                     ": master / exp_avg / exp_avg_sq sizes differ (", n, ", ", m.numel(), ", ", v.numel(), ")");
      master = master.to(torch::kFloat), m = m.to(torch::kFloat), v = v.to(torch::kFloat);
      int64_t src = 0;
      for (const auto& piece : pieces) {
        PT_INPUT_CHECK(piece.is_array() && piece.size() == 4 && piece[0].is_string() && piece[1].is_array() &&
                           piece[2].is_number_integer() && piece[3].is_number_integer(),
                       origin, ": malformed piece ", piece.dump());
        const std::string name = piece[0].get<std::string>();
        std::vector<int64_t> shape;
        int64_t numel = 1;
        for (const auto& d : piece[1]) {
          PT_INPUT_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0 && d.get<int64_t>() < (int64_t{1} << 40),
                         origin, ": parameter '", name, "' has a bad dimension ", d.dump());
          shape.push_back(d.get<int64_t>());
          numel *= shape.back();
          PT_INPUT_CHECK(numel < (int64_t{1} << 40), origin, ": parameter '", name, "' is implausibly large");
        }
        const int64_t begin = piece[2].get<int64_t>(), length = piece[3].get<int64_t>();
        PT_INPUT_CHECK(begin >= 0 && length >= 0 && begin + length <= numel && src + length <= n, origin,
                       ": piece of '", name, "' [", begin, ", ", begin + length, ") is out of range");
        visit(ZeroPiece{name, shape, numel, begin, length, master.narrow(0, src, length), m.narrow(0, src, length),
                        v.narrow(0, src, length), origin});
        src += length;
      }
      PT_INPUT_CHECK(src == n, origin, ": pieces cover ", src, " elements, the tensors hold ", n);
    });
  }
  PT_INPUT_CHECK(step.has_value(), reader.origin(), ": no ZeRO optimizer shards (shard_<rank>.pt)");
  return *step;
}

ZeroConsolidated consolidate_zero_shards(const ShardReader& reader) {
  ZeroConsolidated out;
  std::map<std::string, size_t> index;
  std::vector<at::Tensor> seen;  // per parameter: how often each element was restored
  std::set<std::string> files;
  out.step = for_each_zero_piece(reader, [&](const ZeroPiece& pc) {
    files.insert(pc.origin);
    auto it = index.find(pc.name);
    if (it == index.end()) {
      it = index.emplace(pc.name, out.params.size()).first;
      ZeroParamState p;
      p.shape = pc.shape;
      p.master = torch::zeros({pc.numel}, torch::kFloat);
      p.exp_avg = torch::zeros({pc.numel}, torch::kFloat);
      p.exp_avg_sq = torch::zeros({pc.numel}, torch::kFloat);
      out.params.emplace_back(pc.name, std::move(p));
      seen.push_back(torch::zeros({pc.numel}, torch::kInt));
    }
    ZeroParamState& p = out.params[it->second].second;
    PT_INPUT_CHECK(p.shape == pc.shape, pc.origin, ": parameter '", pc.name, "' has shape ", c10::IntArrayRef(pc.shape),
                   " here and ", c10::IntArrayRef(p.shape), " in another shard");
    p.master.narrow(0, pc.begin, pc.length).copy_(pc.master);
    p.exp_avg.narrow(0, pc.begin, pc.length).copy_(pc.exp_avg);
    p.exp_avg_sq.narrow(0, pc.begin, pc.length).copy_(pc.exp_avg_sq);
    seen[it->second].narrow(0, pc.begin, pc.length).add_(1);
  });
  out.shards = static_cast<int64_t>(files.size());
  for (size_t i = 0; i < out.params.size(); ++i) {
    auto& [name, p] = out.params[i];
    const int64_t missing = seen[i].eq(0).sum().item<int64_t>(), twice = seen[i].gt(1).sum().item<int64_t>();
    PT_INPUT_CHECK(missing == 0 && twice == 0, reader.origin(), ": parameter '", name, "' has ", missing,
                   " elements missing from the shards and ", twice, " saved more than once");
    out.elements += p.master.numel();
    p.master = p.master.view(p.shape);
    p.exp_avg = p.exp_avg.view(p.shape);
    p.exp_avg_sq = p.exp_avg_sq.view(p.shape);
  }
  return out;
}

}  // namespace polytrain
