#include "polytrain/common/fault_tolerance_config.h"

#include <cstdlib>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace {

const char* const kKey = "trainer.fault_tolerance";

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw InputError((origin.empty() ? std::string() : origin + ": ") + "'" + kKey + "' " + what);
}

}  // namespace

FaultToleranceOptions parse_fault_tolerance(const nlohmann::json& value, const std::string& origin) {
  FaultToleranceOptions o;
  if (value.is_null()) return o;
  if (value.is_boolean()) {
    o.enabled = value.get<bool>();
    return o;
  }
  if (!value.is_object())
    fail(origin, "must be true, false or an object {\"enabled\": true, \"min_world_size\": N, \"quorum_wait\": S}, got " +
                     value.dump());
  for (const auto& [key, v] : value.items()) {
    if (key == "enabled") {
      if (!v.is_boolean()) fail(origin, ".enabled must be true or false, got " + v.dump());
      o.enabled = v.get<bool>();
    } else if (key == "min_world_size") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        fail(origin, ".min_world_size must be an integer >= 1, got " + v.dump());
      o.min_world_size = v.get<int64_t>();
    } else if (key == "quorum_wait") {
      if (!v.is_number() || !(v.get<double>() > 0)) fail(origin, ".quorum_wait must be a number of seconds > 0, got " + v.dump());
      o.quorum_wait = v.get<double>();
    } else {
      fail(origin, "has no key '" + key + "' (it takes enabled, min_world_size and quorum_wait)");
    }
  }
  // An object that sets min_world_size means fault tolerance unless it says otherwise.
  if (!value.contains("enabled")) o.enabled = true;
  return o;
}

namespace {

const nlohmann::json* block_of(const Config& cfg) {
  const auto& s = cfg.source;
  if (!s.is_object() || !s.contains("trainer") || !s["trainer"].is_object() || !s["trainer"].contains("fault_tolerance"))
    return nullptr;
  return &s["trainer"]["fault_tolerance"];
}

}  // namespace

void resolve_fault_tolerance(Config& cfg, const std::string& origin) {
  const nlohmann::json* block = block_of(cfg);
  if (!block || !parse_fault_tolerance(*block, origin).enabled) return;
  // Only a Gloo group can be rebuilt without the lost ranks: Open MPI as Debian builds it has no
  // ULFM (a lost rank ends the MPI job) and NCCL is not wired for it.
  auto& t = cfg.trainer;
  if (t.comm_backend == "auto") t.comm_backend = "gloo";
  PT_INPUT_CHECK(t.comm_backend == "gloo", "trainer.fault_tolerance: needs trainer.comm_backend gloo (or auto), not '",
                 t.comm_backend, "': ", t.comm_backend == "mpi" ? "Open MPI without ULFM ends the whole job when a rank is lost"
                                                                : "only Gloo groups are rebuilt without lost ranks");
  PT_INPUT_CHECK(t.pytorch_device == "cpu", "trainer.fault_tolerance: runs on the CPU over Gloo only, not on '",
                 t.pytorch_device, "' (trainer.pytorch_device)");
}

FaultToleranceOptions fault_tolerance_options(const Config& cfg) {
  const nlohmann::json* block = block_of(cfg);
  return block ? parse_fault_tolerance(*block, "") : FaultToleranceOptions{};
}

int64_t replacement_attempt() {
  const char* v = std::getenv("POLYTRAIN_FT_JOIN");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  PT_INPUT_CHECK(*end == '\0' && n >= 0, "POLYTRAIN_FT_JOIN='", v, "' is not a restart count");
  return n;
}

}  // namespace polytrain
