// The quorum over the rendezvous store and the micro-batch plan of fault_tolerance.h.
#include "polytrain/parallel/ddp/fault_tolerance.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "polytrain/common/error.h"

namespace polytrain {

using detail::cat;

std::vector<MicroBatchSlot> micro_batch_plan(const std::vector<int64_t>& members, int64_t original,
                                             int64_t accumulation, int64_t me) {
  std::vector<MicroBatchSlot> plan;
  for (int64_t k = 0; k < accumulation; ++k) plan.push_back({me, k});
  const auto place = std::find(members.begin(), members.end(), me) - members.begin();
  int64_t dealt = 0;
  for (int64_t lost = 0; lost < original; ++lost) {
    if (std::find(members.begin(), members.end(), lost) != members.end()) continue;
    for (int64_t k = 0; k < accumulation; ++k, ++dealt)
      if (dealt % static_cast<int64_t>(members.size()) == place) plan.push_back({lost, k});
  }
  return plan;
}

std::string rank_list(const std::vector<int64_t>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

namespace {

std::string csv(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::vector<int64_t> parse_csv(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

// The members of `previous` that have registered so far.
std::vector<int64_t> registered(const StoreOps& store, const std::string& base, const std::vector<int64_t>& previous) {
  std::vector<int64_t> alive;
  for (int64_t m : previous)
    if (store.has(base + "alive/" + std::to_string(m))) alive.push_back(m);
  return alive;
}

}  // namespace

std::vector<int64_t> agree_membership(const StoreOps& store, int64_t generation, int64_t me,
                                      const std::vector<int64_t>& previous, int64_t step,
                                      std::chrono::milliseconds settle) {
  const std::string base = cat("ft/g", generation, "/");
  store.set(base + "alive/" + std::to_string(me), std::to_string(step));
  // A survivor learns of the failure when its own collective fails, which the others' dropped
  // connections make quick; `settle` bounds the wait for one that is busy computing.
  // Rank 0 hosts the store: while the store answers, its process lives, and a group without it
  // cannot go on. So the quorum waits longer for it (a loaded machine once made rank 0 register
  // more than `settle` after the others, who then closed the quorum without it and lost the job).
  const auto now = std::chrono::steady_clock::now();
  const auto deadline = now + settle;
  const auto host_deadline = now + std::max<std::chrono::milliseconds>(settle, std::chrono::seconds(30));
  const bool host_expected = std::find(previous.begin(), previous.end(), 0) != previous.end();
  auto waiting = [&](const std::vector<int64_t>& alive) {
    const auto t = std::chrono::steady_clock::now();
    if (t < deadline) return true;
    return host_expected && t < host_deadline && std::find(alive.begin(), alive.end(), 0) == alive.end();
  };
  std::vector<int64_t> alive = registered(store, base, previous);
  while (alive.size() < previous.size() && waiting(alive) && !store.has(base + "members")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    alive = registered(store, base, previous);
  }
  const std::vector<int64_t> members = parse_csv(store.set_once(base + "members", csv(alive)));
  if (std::find(members.begin(), members.end(), me) == members.end())
    throw Error(cat("fault tolerance: rank ", me, " reached the quorum of membership generation ", generation,
                    " after it closed (members ", rank_list(members), "); it leaves the job"));
  for (int64_t m : members) {
    const std::string theirs = store.get(base + "alive/" + std::to_string(m));
    if (theirs != std::to_string(step))
      throw Error(cat("fault tolerance: rank ", m, " stands at step ", theirs, ", rank ", me, " at step ", step,
                      ": the interrupted step completed on some ranks only, which this version cannot redo"));
  }
  return members;
}

namespace {
std::string join_key(int64_t me) { return cat("ft/join/", me); }
std::string admission_key(int64_t me, int64_t attempt) { return cat("ft/join/", me, "/", attempt); }
}  // namespace

void request_join(const StoreOps& store, int64_t me, int64_t attempt) { store.set(join_key(me), std::to_string(attempt)); }

std::vector<int64_t> pending_joins(const StoreOps& store, const std::vector<int64_t>& members, int64_t original,
                                   const std::vector<int64_t>& admitted) {
  std::vector<int64_t> pending(static_cast<size_t>(original), -1);
  for (int64_t m = 0; m < original; ++m) {
    if (std::find(members.begin(), members.end(), m) != members.end() || !store.has(join_key(m))) continue;
    const int64_t attempt = std::stoll(store.get(join_key(m)));
    if (attempt > admitted.at(static_cast<size_t>(m))) pending[static_cast<size_t>(m)] = attempt;
  }
  return pending;
}

// The record: "generation;members;step;count", then each shared string on its own key.
void write_admission(const StoreOps& store, int64_t me, int64_t attempt, const Admission& a) {
  const std::string key = admission_key(me, attempt);
  for (size_t i = 0; i < a.shared.size(); ++i) store.set(cat(key, "/shared/", i), a.shared[i]);
  store.set(key, cat(a.generation, ";", csv(a.members), ";", a.step, ";", a.shared.size()));
}

Admission await_admission(const StoreOps& store, int64_t me, int64_t attempt,
                          std::chrono::steady_clock::time_point deadline) {
  const std::string key = admission_key(me, attempt);
  while (!store.has(key)) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw Error(cat("fault tolerance: rank ", me, " (a replacement) was not admitted in time: the others did not "
                      "reach a step boundary, or the job has ended"));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::vector<std::string> f;
  std::stringstream in(store.get(key));
  for (std::string item; std::getline(in, item, ';');) f.push_back(item);
  PT_CHECK(f.size() == 4, "fault tolerance: malformed admission record under ", key);
  Admission a;
  a.generation = std::stoll(f[0]);
  a.members = parse_csv(f[1]);
  a.step = std::stoll(f[2]);
  for (int64_t i = 0; i < std::stoll(f[3]); ++i) a.shared.push_back(store.get(cat(key, "/shared/", i)));
  return a;
}

}  // namespace polytrain
