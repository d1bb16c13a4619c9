// The universal optimizer-state layout (see universal_state.h): writing pieces, reading and
// checking them, and the bridge to whole-parameter optimizers' own archives.
#include "polytrain/parallel/universal_state.h"

#include <algorithm>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/optim/optimizers_8bit.h"

namespace polytrain {

using detail::cat;
using json = nlohmann::json;

namespace {

constexpr int64_t kFormat = 1;
constexpr int64_t kMaxElements = int64_t{1} << 40;

std::string shape_text(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TpShardSpec spec_of(const StateSplit& s, const std::vector<int64_t>& whole_shape) {
  TpShardSpec spec;
  spec.dim = s.dim;
  spec.blocks = s.blocks;
  spec.vocab = s.vocab;
  spec.whole = whole_shape.at(static_cast<size_t>(s.dim));
  return spec;
}

// The shape of part `s.part` of a tensor of `whole` shape (tp_slice's arithmetic).
std::vector<int64_t> part_shape(const std::vector<int64_t>& whole, const StateSplit& s) {
  if (s.parts == 1) return whole;
  auto shape = whole;
  const int64_t w = whole[static_cast<size_t>(s.dim)];
  shape[static_cast<size_t>(s.dim)] = s.vocab ? (w + s.parts - 1) / s.parts : w / s.parts;
  return shape;
}

// Archives round-trip through bytes: an OutputArchive cannot be read back directly.
void reopen(torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
  std::ostringstream os;
  out.save_to(os);
  std::istringstream is(os.str());
  in.load_from(is);
}

// The optimizer's own archive (names + s<i>, optimizers.h), opened for reading; returns "names".
c10::IValue open_optimizer_archive(const Optimizer& opt, torch::serialize::InputArchive& a) {
  torch::serialize::OutputArchive saved;
  opt.save(saved);
  reopen(saved, a);
  c10::IValue names;
  a.read("names", names);
  return names;
}

// One parameter being put together: per TP part, its flat statistics and coverage.
struct Assembly {
  std::vector<int64_t> shape;
  std::optional<StateSplit> split;  // the split its pieces were saved with (parts 1: whole)
  std::optional<int64_t> step;
  std::set<std::string> stat_names;
  bool stats_fixed = false;
  std::map<int64_t, std::map<std::string, at::Tensor>> parts;  // part -> stat -> [part numel]
  std::map<int64_t, at::Tensor> covered;                       // part -> int32 counts
  std::map<int64_t, std::map<std::string, at::Tensor>> blobs;  // part -> blobs of the piece covering it whole
};

}  // namespace

StateSplit state_split(const TpShardSpec& spec, int64_t part, int64_t parts) {
  StateSplit s;
  s.dim = spec.dim;
  s.blocks = spec.blocks;
  s.vocab = spec.vocab;
  s.part = part;
  s.parts = parts;
  return s;
}

void write_state_pieces(torch::serialize::OutputArchive& archive, const std::vector<StatePiece>& pieces) {
  json index = json::array();
  std::map<std::string, std::vector<at::Tensor>> by_stat;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const StatePiece& p = pieces[i];
    json split = p.split.parts == 1 ? json(nullptr)
                                    : json::array({p.split.dim, p.split.blocks, p.split.vocab ? 1 : 0, p.split.part,
                                                   p.split.parts});
    json stats = json::array();
    for (const auto& [name, t] : p.stats) {
      PT_CHECK(t.numel() == p.length, "state piece of '", p.name, "': ", name, " has ", t.numel(), " elements, not ",
               p.length);
      stats.push_back(name);
      by_stat[name].push_back(t.detach().reshape({-1}).to(at::kCPU, at::kFloat));
    }
    json entry = {p.name, p.whole_shape, split, p.begin, p.length, p.step, stats};
    if (!p.blobs.empty()) {  // an 8th field only when there are blobs (older readers take 7)
      json blobs = json::array();
      for (const auto& [name, t] : p.blobs) {
        blobs.push_back(name);
        archive.write("blob_" + std::to_string(i) + "_" + name, t.detach().to(at::kCPU).contiguous());
      }
      entry.push_back(blobs);
    }
    index.push_back(entry);
  }
  archive.write("universal_format", c10::IValue(kFormat));
  archive.write("pieces", c10::IValue(index.dump()));
  std::vector<std::string> names;
  for (auto& [name, parts] : by_stat) {
    names.push_back(name);
    archive.write("stat_" + name, torch::cat(parts));
  }
  archive.write("stat_names", c10::IValue(c10::List<std::string>(names)));
}

at::Tensor ParamState::local(const std::string& stat, const TpShardSpec* spec, int64_t rank, int64_t size) const {
  auto it = stats.find(stat);
  if (it == stats.end()) return at::Tensor();
  return (spec ? tp_slice(it->second, *spec, rank, size) : it->second).reshape({-1});
}

const ParamState* UniversalState::find(const std::string& name) const {
  for (const auto& [n, p] : params)
    if (n == name) return &p;
  return nullptr;
}

bool has_universal_state(const ShardReader& reader) {
  for (int64_t s = 0; s < reader.saved_world_size(); ++s) {
    if (!reader.has_shard(s)) continue;
    bool yes = false;
    reader.read_shard(s, [&](torch::serialize::InputArchive& a, const std::string&) {
      c10::IValue v;
      yes = a.try_read("universal_format", v) || a.try_read("zero_format", v);
    });
    return yes;
  }
  return false;
}

namespace {

// The pieces of one shard, in the universal layout or ZeRO's zero_format 1 (whole parameters,
// master / exp_avg / exp_avg_sq for every piece, one step for all).
std::vector<StatePiece> read_pieces(torch::serialize::InputArchive& a, const std::string& origin) {
  c10::IValue format, index_iv;
  const bool universal = a.try_read("universal_format", format);
  const bool zero1 = !universal && a.try_read("zero_format", format);
  PT_INPUT_CHECK((universal || zero1) && format.isInt() && format.toInt() == kFormat, origin,
                 ": not an optimizer shard of the universal layout (no universal_format 1)");
  PT_INPUT_CHECK(a.try_read("pieces", index_iv) && index_iv.isString(), origin, ": no 'pieces'");
  json index;
  try {
    index = json::parse(index_iv.toStringRef());
  } catch (const std::exception& e) {
    throw InputError(cat(origin, ": unreadable 'pieces': ", e.what()));
  }
  PT_INPUT_CHECK(index.is_array(), origin, ": 'pieces' is not a list");
  std::map<std::string, at::Tensor> stat_tensors;
  int64_t zero_step = 0;
  if (universal) {
    c10::IValue names;
    PT_INPUT_CHECK(a.try_read("stat_names", names) && names.isList(), origin, ": no 'stat_names'");
    for (const auto& n : names.toListRef()) {
      at::Tensor t;
      PT_INPUT_CHECK(n.isString() && a.try_read("stat_" + n.toStringRef(), t), origin, ": statistic '",
                     n.isString() ? n.toStringRef() : "?", "' is listed but missing");
      stat_tensors[n.toStringRef()] = t.to(at::kFloat).reshape({-1});
    }
  } else {
    at::Tensor step_t;
    for (const char* k : {"master", "exp_avg", "exp_avg_sq"}) {
      at::Tensor t;
      PT_INPUT_CHECK(a.try_read(k, t), origin, ": ZeRO shard without '", k, "'");
      stat_tensors[k] = t.to(at::kFloat).reshape({-1});
    }
    PT_INPUT_CHECK(a.try_read("step", step_t) && step_t.numel() == 1, origin, ": 'step' must hold one value");
    zero_step = step_t.item<int64_t>();
  }
  std::map<std::string, int64_t> offset;
  std::vector<StatePiece> out;
  for (size_t i = 0; i < index.size(); ++i) {
    const json& e = index[i];
    const bool ok = universal ? e.is_array() && (e.size() == 7 || (e.size() == 8 && e[7].is_array())) &&
                                    e[0].is_string() && e[1].is_array() &&
                                    (e[2].is_null() || (e[2].is_array() && e[2].size() == 5)) &&
                                    e[3].is_number_integer() && e[4].is_number_integer() && e[5].is_number_integer() &&
                                    e[6].is_array()
                              : e.is_array() && e.size() == 4 && e[0].is_string() && e[1].is_array() &&
                                    e[2].is_number_integer() && e[3].is_number_integer();
    PT_INPUT_CHECK(ok, origin, ": malformed piece ", e.dump());
    StatePiece p;
    p.name = e[0].get<std::string>();
    for (const auto& d : e[1]) {
      PT_INPUT_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0 && d.get<int64_t>() < kMaxElements, origin,
                     ": parameter '", p.name, "' has a bad dimension ", d.dump());
      p.whole_shape.push_back(d.get<int64_t>());
    }
    PT_INPUT_CHECK(numel_of(p.whole_shape) < kMaxElements, origin, ": parameter '", p.name, "' is implausibly large");
    std::vector<std::string> stats = {"master", "exp_avg", "exp_avg_sq"};
    if (universal) {
      if (!e[2].is_null()) {
        for (const auto& v : e[2])
          PT_INPUT_CHECK(v.is_number_integer(), origin, ": parameter '", p.name, "' has a malformed split ", e[2].dump());
        p.split = StateSplit{e[2][0].get<int64_t>(), e[2][1].get<int64_t>(), e[2][2].get<int64_t>() != 0,
                             e[2][3].get<int64_t>(), e[2][4].get<int64_t>()};
        const StateSplit& s = p.split;
        PT_INPUT_CHECK(s.dim >= 0 && s.dim < static_cast<int64_t>(p.whole_shape.size()) && s.blocks >= 1 &&
                           s.parts >= 1 && s.parts < kMaxElements && s.part >= 0 && s.part < s.parts &&
                           (s.vocab || p.whole_shape[s.dim] % (s.blocks * s.parts) == 0),
                       origin, ": parameter '", p.name, "' has a split ", e[2].dump(), " that does not fit its shape ",
                       shape_text(p.whole_shape));
      }
      p.begin = e[3].get<int64_t>();
      p.length = e[4].get<int64_t>();
      p.step = e[5].get<int64_t>();
      stats.clear();
      for (const auto& s : e[6]) {
        PT_INPUT_CHECK(s.is_string() && stat_tensors.count(s.get<std::string>()), origin, ": parameter '", p.name,
                       "' names a statistic the shard does not hold: ", s.dump());
        stats.push_back(s.get<std::string>());
      }
      if (e.size() == 8) {
        for (const auto& b : e[7]) {
          at::Tensor t;
          PT_INPUT_CHECK(b.is_string() && a.try_read("blob_" + std::to_string(i) + "_" + b.get<std::string>(), t),
                         origin, ": parameter '", p.name, "' names a blob the shard does not hold: ", b.dump());
          p.blobs.emplace_back(b.get<std::string>(), t);
        }
      }
    } else {
      p.begin = e[2].get<int64_t>();
      p.length = e[3].get<int64_t>();
      p.step = zero_step;
    }
    const int64_t n = numel_of(part_shape(p.whole_shape, p.split));
    PT_INPUT_CHECK(p.begin >= 0 && p.length >= 0 && p.begin + p.length <= n && p.step >= 0, origin, ": piece of '",
                   p.name, "' [", p.begin, ", ", p.begin + p.length, ") is out of range (", n, " elements)");
    for (const auto& s : stats) {
      const at::Tensor& t = stat_tensors[s];
      int64_t& off = offset[s];
      PT_INPUT_CHECK(off + p.length <= t.numel(), origin, ": statistic '", s, "' ends before the piece of '", p.name,
                     "'");
      p.stats.emplace_back(s, t.narrow(0, off, p.length));
      off += p.length;
    }
    out.push_back(std::move(p));
  }
  for (const auto& [s, t] : stat_tensors)
    PT_INPUT_CHECK(offset[s] == t.numel(), origin, ": the pieces cover ", offset[s], " elements of statistic '", s,
                   "', the shard holds ", t.numel());
  return out;
}

}  // namespace

UniversalState read_universal_state(const ShardReader& reader) {
  std::vector<std::string> order;
  std::map<std::string, Assembly> work;
  UniversalState out;
  for (int64_t r = 0; r < reader.saved_world_size(); ++r) {
    if (!reader.has_shard(r)) continue;
    ++out.shards;
    reader.read_shard(r, [&](torch::serialize::InputArchive& a, const std::string& origin) {
      for (auto& p : read_pieces(a, origin)) {
        auto [it, fresh] = work.try_emplace(p.name);
        Assembly& as = it->second;
        if (fresh) {
          order.push_back(p.name);
          as.shape = p.whole_shape;
          as.split = p.split;
        }
        PT_INPUT_CHECK(as.shape == p.whole_shape, origin, ": parameter '", p.name, "' has shape ",
                       shape_text(p.whole_shape), " here and ", shape_text(as.shape), " in another shard");
        PT_INPUT_CHECK(as.split->parts == p.split.parts && as.split->dim == p.split.dim &&
                           as.split->blocks == p.split.blocks && as.split->vocab == p.split.vocab,
                       origin, ": parameter '", p.name, "' is split in ", p.split.parts, " here and in ",
                       as.split->parts, " in another shard");
        PT_INPUT_CHECK(!as.step || *as.step == p.step || p.length == 0, origin, ": parameter '", p.name, "' is at step ",
                       p.step, " here and ", *as.step, " in another shard");
        if (p.length > 0) as.step = p.step;
        std::set<std::string> names;
        for (const auto& [s, t] : p.stats) names.insert(s);
        if (p.length > 0) {
          PT_INPUT_CHECK(!as.stats_fixed || names == as.stat_names, origin, ": parameter '", p.name,
                         "' has other statistics here than in another shard");
          as.stat_names = names;
          as.stats_fixed = true;
        }
        const int64_t n = numel_of(part_shape(p.whole_shape, p.split));
        auto& cov = as.covered[p.split.part];
        if (!cov.defined()) cov = torch::zeros({n}, torch::kInt);
        cov.narrow(0, p.begin, p.length).add_(1);
        auto& part = as.parts[p.split.part];
        for (const auto& [s, t] : p.stats) {
          auto& dst = part[s];
          if (!dst.defined()) dst = torch::zeros({n}, torch::kFloat);
          dst.narrow(0, p.begin, p.length).copy_(t);
        }
        if (!p.blobs.empty() && p.begin == 0 && p.length == n)  // blobs describe whole parts only
          as.blobs[p.split.part] = std::map<std::string, at::Tensor>(p.blobs.begin(), p.blobs.end());
      }
    });
  }
  PT_INPUT_CHECK(out.shards > 0, reader.origin(), ": no optimizer shards (shard_<rank>.pt)");
  for (const auto& name : order) {
    Assembly& as = work[name];
    const StateSplit& split = *as.split;
    ParamState ps;
    ps.shape = as.shape;
    ps.step = as.step.value_or(0);
    for (int64_t part = 0; part < split.parts; ++part) {
      auto it = as.covered.find(part);
      PT_INPUT_CHECK(it != as.covered.end(), reader.origin(), ": optimizer state of parameter '", name,
                     "' has no tensor-parallel part ", part, " of ", split.parts, " (a shard is missing)");
      const int64_t lo = it->second.min().item<int64_t>(), hi = it->second.max().item<int64_t>();
      PT_INPUT_CHECK(lo == 1 && hi == 1, reader.origin(), ": optimizer state of parameter '", name, "'",
                     split.parts > 1 ? cat(" (part ", part, " of ", split.parts, ")") : std::string(), " is ",
                     lo == 0 ? "missing elements (a gap)" : "saved more than once (an overlap)");
    }
    const auto local_shape = part_shape(as.shape, split);
    if (!as.stat_names.count("exp_avg") && !as.blobs.empty() && as.blobs.size() == static_cast<size_t>(split.parts)) {
      // An 8-bit optimizer's state: its moments in fp32 too, for any other optimizer or grid.
      std::map<int64_t, std::map<std::string, at::Tensor>> moments;
      for (const auto& [part, blobs] : as.blobs)
        moments[part] = optim8bit::dequantize_saved(blobs, numel_of(local_shape),
                                                    cat(reader.origin(), ": parameter '", name, "'"));
      if (!moments.begin()->second.empty())
        for (auto& [part, stats] : moments)
          for (auto& [s, t] : stats) {
            as.parts[part][s] = t;
            as.stat_names.insert(s);
          }
    }
    ps.saved_parts = split.parts;
    ps.blobs = as.blobs;
    for (const auto& s : as.stat_names) {
      std::vector<at::Tensor> parts;
      for (int64_t part = 0; part < split.parts; ++part) {
        at::Tensor t = as.parts[part][s];
        PT_INPUT_CHECK(t.defined(), reader.origin(), ": parameter '", name, "' has no '", s, "' in part ", part);
        parts.push_back(t.view(local_shape));
      }
      ps.stats[s] = split.parts == 1 ? parts.front() : tp_assemble(parts, spec_of(split, as.shape));
    }
    out.elements += numel_of(as.shape);
    out.step = std::max(out.step, ps.step);
    out.params.emplace_back(name, std::move(ps));
  }
  return out;
}

std::vector<StatePiece> optimizer_pieces(const Optimizer& opt, const std::map<std::string, PieceLayout>& layout) {
  torch::serialize::InputArchive a;
  const c10::IValue names = open_optimizer_archive(opt, a);
  std::vector<StatePiece> out;
  size_t i = 0;
  for (const auto& n : names.toListRef()) {
    const std::string name = n.toStringRef();
    auto it = layout.find(name);
    PT_CHECK(it != layout.end(), "optimizer parameter '", name, "' is not in the backend's layout");
    StatePiece p;
    p.name = name;
    p.whole_shape = it->second.whole_shape;
    p.split = it->second.split;
    p.length = numel_of(it->second.local_shape);
    torch::serialize::InputArchive one;
    if (a.try_read("s" + std::to_string(i), one)) {
      for (const auto& key : one.keys()) {
        c10::IValue v;
        if (!one.try_read(key, v)) continue;
        if (key == "step") {
          if (v.isInt()) p.step = v.toInt();
          else if (v.isTensor() && v.toTensor().numel() == 1) p.step = static_cast<int64_t>(v.toTensor().item<double>());
        } else if (v.isTensor() && v.toTensor().numel() == p.length && v.toTensor().numel() > 0 &&
                   v.toTensor().is_floating_point() && !optim8bit::is_quantized_state_key(key)) {
          p.stats.emplace_back(key, v.toTensor());
        } else if (v.isTensor()) {
          p.blobs.emplace_back(key, v.toTensor());  // not per element: kept as is, for the same part
        }
      }
    }
    out.push_back(std::move(p));
    ++i;
  }
  return out;
}

void load_optimizer_state(Optimizer& opt, const UniversalState& state,
                          const std::map<std::string, const TpShardSpec*>& specs, int64_t tp_rank, int64_t tp_size,
                          const std::string& origin) {
  torch::serialize::InputArchive cur;
  const c10::IValue names = open_optimizer_archive(opt, cur);
  torch::serialize::OutputArchive built;
  size_t i = 0;
  for (const auto& n : names.toListRef()) {
    const std::string name = n.toStringRef();
    const ParamState* ps = state.find(name);
    PT_INPUT_CHECK(ps, origin, ": no optimizer state for parameter '", name, "' (saved from another model?)");
    auto sp = specs.find(name);
    const TpShardSpec* spec = sp == specs.end() ? nullptr : sp->second;
    bool any = false;
    torch::serialize::OutputArchive one;
    for (const auto& [stat, whole] : ps->stats) {
      if (stat == "master") continue;
      at::Tensor t = spec ? tp_slice(whole, *spec, tp_rank, tp_size) : whole;
      one.write(stat, t.contiguous());
      any = true;
    }
    // Blobs saved from this very part (the same TP split): an 8-bit state restored exactly.
    const int64_t part = spec ? tp_rank : 0, parts = spec ? tp_size : 1;
    auto blobs = ps->blobs.find(part);
    if (ps->saved_parts == parts && blobs != ps->blobs.end()) {
      for (const auto& [key, t] : blobs->second) one.write(key, t);
      any = true;
    }
    if (any) {
      one.write("step", c10::IValue(ps->step));
      built.write("s" + std::to_string(i), one);
    }
    ++i;
  }
  built.write("names", names);
  torch::serialize::InputArchive in;
  reopen(built, in);
  opt.load(in, origin);
}

}  // namespace polytrain
