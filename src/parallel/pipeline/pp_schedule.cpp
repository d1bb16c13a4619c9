#include "polytrain/parallel/pipeline/pp_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "polytrain/common/error.h"

namespace polytrain {

using detail::cat;

std::string pipeline_schedule_error(const std::string& kind, int64_t stages, int64_t virtual_stages, int64_t micro_batches) {
  if (kind != "1f1b" && kind != "gpipe" && kind != "zbh1")
    return cat("pipeline.schedule must be 1f1b, gpipe or zbh1, got '", kind, "'");
  if (stages < 1 || virtual_stages < 1 || micro_batches < 1)
    return cat("a pipeline needs >= 1 stage, virtual stage and micro-batch, got ", stages, ", ", virtual_stages, ", ",
               micro_batches);
  if (virtual_stages > 1 && kind != "1f1b")
    return cat("pipeline.virtual_stages (", virtual_stages, ") interleaves the 1f1b schedule, not ", kind);
  if (virtual_stages > 1 && micro_batches < stages)
    return cat("the interleaved schedule (pipeline.virtual_stages ", virtual_stages, ") needs at least as many "
               "micro-batches per step (gradient_accumulation_steps, ", micro_batches, ") as pipeline stages (", stages,
               ")");
  if (virtual_stages > 1 && micro_batches % stages != 0)
    return cat("the interleaved schedule (pipeline.virtual_stages ", virtual_stages, ") needs the micro-batches per "
               "step (gradient_accumulation_steps, ", micro_batches, ") to be a multiple of the pipeline stages (",
               stages, "), as Megatron's");
  return "";
}

namespace {

// ZB-H1's lists: 1F1B's order of forwards and B passes on every stage, and each stage's W passes
// placed by a replay in unit time (F, B and W one unit each, about a transformer's proportions):
// a stage runs a pending W when its next F or B would wait, or when more than P - s - 1 are
// pending (1F1B's activation bound), and the rest at the end. The F/B order is 1F1B's, so the
// messages keep their order; a W sends nothing, so where it goes cannot deadlock.
std::vector<std::vector<PipeAction>> zbh1_lists(int64_t P, int64_t M) {
  std::vector<std::vector<PipeAction>> base(P), out(P);
  for (int64_t s = 0; s < P; ++s) base[s] = pipeline_schedule("1f1b", P, 1, M, s);
  std::map<std::tuple<bool, int64_t, int64_t>, int64_t> done;  // (forward, micro, stage) -> end tick
  std::vector<size_t> next(P, 0);
  std::vector<std::vector<int64_t>> pending(P);
  for (int64_t t = 0;; ++t) {
    bool left = false;
    std::vector<std::tuple<bool, int64_t, int64_t>> finished;
    for (int64_t s = 0; s < P; ++s) {
      const bool more = next[s] < base[s].size();
      if (!more && pending[s].empty()) continue;
      left = true;
      bool ready = false;
      if (more) {
        const PipeAction& a = base[s][next[s]];
        auto dep = a.forward ? std::make_tuple(true, a.micro, s - 1)
                             : s == P - 1 ? std::make_tuple(true, a.micro, s) : std::make_tuple(false, a.micro, s + 1);
        auto it = done.find(dep);
        ready = (a.forward && s == 0) || (it != done.end() && it->second <= t);
      }
      const bool over = static_cast<int64_t>(pending[s].size()) > P - s - 1;
      if (!pending[s].empty() && (over || !ready)) {
        out[s].push_back(PipeAction{false, true, pending[s].front(), 0});
        pending[s].erase(pending[s].begin());
      } else if (ready) {
        const PipeAction& a = base[s][next[s]++];
        out[s].push_back(a);
        finished.emplace_back(a.forward, a.micro, s);
        if (!a.forward) pending[s].push_back(a.micro);
      }
    }
    for (const auto& f : finished) done[f] = t + 1;
    if (!left) break;
  }
  return out;
}

}  // namespace

std::vector<PipeAction> pipeline_schedule(const std::string& kind, int64_t P, int64_t V, int64_t M, int64_t s) {
  const std::string e = pipeline_schedule_error(kind, P, V, M);
  PT_INPUT_CHECK(e.empty(), e);
  PT_CHECK(s >= 0 && s < P, "stage ", s, " outside ", P, " stages");
  std::vector<PipeAction> out;
  auto F = [&](int64_t m, int64_t v) { out.push_back(PipeAction{true, false, m, v}); };
  auto B = [&](int64_t m, int64_t v) { out.push_back(PipeAction{false, false, m, v}); };
  if (kind == "zbh1") return zbh1_lists(P, M).at(static_cast<size_t>(s));
  if (kind == "gpipe") {
    for (int64_t m = 0; m < M; ++m) F(m, 0);
    for (int64_t m = 0; m < M; ++m) B(m, 0);
    return out;
  }
  if (V == 1) {  // PipeDream-flush
    const int64_t warmup = std::min(P - s - 1, M);
    for (int64_t m = 0; m < warmup; ++m) F(m, 0);
    for (int64_t i = 0; i < M - warmup; ++i) {
      F(warmup + i, 0);
      B(i, 0);
    }
    for (int64_t m = M - warmup; m < M; ++m) B(m, 0);
    return out;
  }
  // Megatron's interleaved order: the k-th forward of a stage runs micro-batch
  // (k / (P V)) P + k mod P on chunk (k mod P V) / P; backwards run the chunks in reverse.
  const int64_t total = M * V;
  auto micro_of = [&](int64_t k) { return (k / (P * V)) * P + k % P; };
  auto chunk_of = [&](int64_t k, bool forward) {
    const int64_t c = (k % (P * V)) / P;
    return forward ? c : V - 1 - c;
  };
  const int64_t warmup = M == P ? total : std::min((P - s - 1) * 2 + (V - 1) * P, total);
  for (int64_t k = 0; k < warmup; ++k) F(micro_of(k), chunk_of(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) {
    F(micro_of(k + warmup), chunk_of(k + warmup, true));
    B(micro_of(k), chunk_of(k, false));
  }
  for (int64_t k = total - warmup; k < total; ++k) B(micro_of(k), chunk_of(k, false));
  return out;
}

ScheduleReplay simulate_schedule(const std::string& kind, int64_t P, int64_t V, int64_t M, double fc, double bc) {
  std::vector<std::vector<PipeAction>> lists;
  for (int64_t s = 0; s < P; ++s) lists.push_back(pipeline_schedule(kind, P, V, M, s));
  const int64_t G = P * V;
  std::map<std::tuple<bool, int64_t, int64_t>, double> done;  // (forward, micro, global chunk) -> end time
  std::vector<size_t> next(P, 0);
  std::vector<double> free_at(P, 0.0), busy(P, 0.0);
  std::vector<int64_t> in_flight(P, 0);
  ScheduleReplay r;
  r.peak_in_flight.assign(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < P; ++s) {
      while (next[s] < lists[s].size()) {
        const PipeAction& a = lists[s][next[s]];
        const int64_t g = a.chunk * P + s;
        double ready = 0.0;
        if (a.weight) {  // after its own B, earlier in this stage's list
        } else if (a.forward && g > 0) {
          auto it = done.find({true, a.micro, g - 1});
          if (it == done.end()) break;
          ready = it->second;
        } else if (!a.forward) {
          auto it = g == G - 1 ? done.find({true, a.micro, g}) : done.find({false, a.micro, g + 1});
          if (it == done.end()) break;
          ready = it->second;
        }
        const bool split = kind == "zbh1";
        const double cost = a.forward ? fc : split ? bc / 2 : bc;
        const double end = std::max(ready, free_at[s]) + cost;
        free_at[s] = end;
        busy[s] += cost;
        if (!a.weight) done[{a.forward, a.micro, g}] = end;
        if (a.forward) ++in_flight[s];
        else if (a.weight || !split) --in_flight[s];
        r.peak_in_flight[s] = std::max(r.peak_in_flight[s], in_flight[s]);
        ++next[s];
        progress = true;
      }
    }
  }
  for (int64_t s = 0; s < P; ++s)
    if (next[s] < lists[s].size()) r.deadlock = true;
  r.makespan = *std::max_element(free_at.begin(), free_at.end());
  for (int64_t s = 0; s < P; ++s) r.idle_fraction.push_back(r.makespan > 0 ? 1.0 - busy[s] / r.makespan : 0.0);
  return r;
}

double theoretical_bubble(int64_t P, int64_t V, int64_t M) {
  return static_cast<double>(P - 1) / static_cast<double>(V * M + P - 1);
}

std::vector<int64_t> partition_balanced(const std::vector<double>& w, int64_t parts) {
  const int64_t n = static_cast<int64_t>(w.size());
  PT_CHECK(parts >= 1 && parts <= n, "partition of ", n, " layers into ", parts, " parts");
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + w[i];
  // best[k][i]: the lightest heaviest run splitting the first i layers into k runs.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(parts + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int64_t k = 1; k <= parts; ++k)
    for (int64_t i = k; i <= n - (parts - k); ++i)
      for (int64_t j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {  // ties keep the earliest cut: earlier stages lighter, as DeepSpeed's
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
  std::vector<int64_t> bounds(parts + 1);
  bounds[parts] = n;
  for (int64_t k = parts; k >= 1; --k) bounds[k - 1] = cut[k][bounds[k]];
  return bounds;
}

}  // namespace polytrain
