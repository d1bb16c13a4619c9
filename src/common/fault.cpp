#include "polytrain/common/fault.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "polytrain/common/error.h"

namespace polytrain {
namespace {

struct Fault {
  bool armed = false;
  std::string point;
  long hit = 1;
  int signal = SIGKILL;
  std::string signal_name = "KILL";
  mutable std::atomic<long> seen{0};
};

const char* const kPoints[] = {"rendezvous", "allreduce", "checkpoint", "eval", "step", "join"};

bool parse_long(const std::string& s, long& out) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  out = std::strtol(s.c_str(), nullptr, 10);
  return true;
}

void parse_one(const std::string& item, const std::string& usage, Fault& f) {
  std::vector<std::string> parts;
  std::stringstream ss(item);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  if (parts.size() < 2 || parts.size() > 4) throw InputError(usage);
  long rank = -1;
  if (parts[0] != "*" && !parse_long(parts[0], rank)) throw InputError(usage);
  bool known = false;
  for (const char* p : kPoints) known = known || parts[1] == p;
  if (!known) throw InputError(usage);
  f.point = parts[1];
  if (parts.size() > 2 && (!parse_long(parts[2], f.hit) || f.hit < 1)) throw InputError(usage);
  if (parts.size() > 3) {
    static const std::pair<const char*, int> kSignals[] = {
        {"KILL", SIGKILL}, {"STOP", SIGSTOP}, {"TERM", SIGTERM}, {"SEGV", SIGSEGV}, {"ABRT", SIGABRT}};
    bool found = false;
    for (const auto& [name, sig] : kSignals) {
      if (parts[3] == name) f.signal = sig, f.signal_name = name, found = true;
    }
    if (!found) throw InputError(usage);
  }
  const char* my_rank = std::getenv("RANK");
  // A group's first start only: one that launch --max_restarts restarted would otherwise meet
  // the same fault again, every time. Nor in a replacement launch started for a lost rank
  // (POLYTRAIN_FT_JOIN): it would be lost again the same way.
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* replacement = std::getenv("POLYTRAIN_FT_JOIN");
  f.armed = (rank < 0 || (my_rank && std::to_string(rank) == my_rank) || (!my_rank && rank == 0)) &&
            (!restart || std::string(restart) == "0") && (!replacement || std::string(replacement) == "0");
}

const std::vector<Fault>& faults() {
  static std::vector<Fault> all;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* spec = std::getenv("POLYTRAIN_FAULT");
    if (!spec || !*spec) return;
    const std::string usage = std::string("POLYTRAIN_FAULT='") + spec +
                              "': expected RANK:POINT[:HIT[:SIGNAL]][,...] (POINT rendezvous, allreduce, checkpoint, "
                              "eval, step or join; SIGNAL KILL, STOP, TERM, SEGV or ABRT)";
    std::stringstream ss(spec);
    std::vector<std::string> items;
    for (std::string item; std::getline(ss, item, ',');) items.push_back(item);
    all = std::vector<Fault>(items.size());  // Fault holds an atomic: built in place
    for (size_t i = 0; i < items.size(); ++i) parse_one(items[i], usage, all[i]);
  });
  return all;
}

}  // namespace

void check_fault_spec() { faults(); }

void fault_point(const char* point) {
  for (const Fault& f : faults()) {
    if (!f.armed || f.point != point) continue;
    if (f.seen.fetch_add(1) + 1 != f.hit) continue;
    std::fprintf(stderr, "polytrain: fault injection (POLYTRAIN_FAULT): pid %d sends itself SIG%s at '%s' (pass %ld)\n",
                 static_cast<int>(getpid()), f.signal_name.c_str(), point, f.hit);
    std::fflush(stderr);
    raise(f.signal);
  }
}

}  // namespace polytrain
