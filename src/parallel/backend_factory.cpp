// The only place that knows every backend: ParallelDims -> the strategy over its grid.
#include "polytrain/common/error.h"
#include "polytrain/common/fault_tolerance_config.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/comm_config.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/parallel_dims.h"
#include "polytrain/parallel/replicated_backend.h"
#include "polytrain/parallel/single/single_backend.h"
#include "polytrain/parallel/zero/zero_backend.h"
#if POLYTRAIN_WITH_HIVEMIND
#include "polytrain/parallel/hivemind/hivemind_backend.h"
#endif

namespace polytrain {

std::unique_ptr<Backend> make_backend(const Config& cfg) { return make_backend(cfg, nullptr); }

std::unique_ptr<Backend> make_backend(const Config& cfg, std::unique_ptr<Communicator> world) {
  const auto& type = cfg.trainer.env_type;
  if (type == "hivemind") {
#if POLYTRAIN_WITH_HIVEMIND
    return std::make_unique<HivemindBackend>(cfg);
#else
    throw InputError("trainer.env_type: 'hivemind' needs a build with POLYTRAIN_WITH_HIVEMIND (Debian's "
                     "libopendht-dev, libsodium-dev, libasio-dev, libmsgpack-cxx-dev; scripts/setup.sh installs them)");
#endif
  }
  if (type == "pytorch") {
    resolve_parallel_dims(cfg, world ? world->size() : 1);
    return std::make_unique<SingleBackend>(cfg);
  }
  // A replacement launch started for a lost rank (fault tolerance) joins the running group, not a world.
  if (!world && fault_tolerance_options(cfg).enabled && replacement_attempt() > 0) return std::make_unique<DdpBackend>(cfg);
  if (!world) world = world_communicator(cfg.trainer, parse_device(cfg.trainer.pytorch_device));
  const ParallelDims dims = resolve_parallel_dims(cfg, world->size());
  switch (dims.strategy) {
    case DpStrategy::kReplicate:  // DDP's bucketed all-reduce, after the TP transform when tp > 1
      return std::make_unique<DdpBackend>(cfg, std::move(world));
    case DpStrategy::kZero:  // ZeRO-1/2 over the dp group, after the TP transform when tp > 1
      return std::make_unique<ZeroBackend>(cfg, std::move(world));
    default:
      break;
  }
  throw InternalError("make_backend: no strategy for " + dims.describe());
}

}  // namespace polytrain
