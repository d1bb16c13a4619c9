// The only place that knows every backend: env_type -> Backend.
#include "polytrain/common/error.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/comm_config.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/single/single_backend.h"
#include "polytrain/parallel/tensor_parallel/tp_backend.h"
#include "polytrain/parallel/zero/zero_backend.h"
#if POLYTRAIN_WITH_HIVEMIND
#include "polytrain/parallel/hivemind/backend/hivemind_backend.h"
#endif

namespace polytrain {

std::unique_ptr<Backend> make_backend(const Config& cfg) {
  const auto& type = cfg.trainer.env_type;
  if (type == "pytorch") return std::make_unique<SingleBackend>(cfg);
  if (type == "pytorchDDP") return std::make_unique<DdpBackend>(cfg);
  if (type == "deepspeed") return std::make_unique<ZeroBackend>(cfg);
  if (type == "deepspeed+mpu") return std::make_unique<TensorParallelBackend>(cfg);
#if POLYTRAIN_WITH_HIVEMIND
  if (type == "hivemind") return std::make_unique<HivemindBackend>(cfg);
#else
  if (type == "hivemind")
    throw InputError("trainer.env_type: 'hivemind' needs a build with POLYTRAIN_WITH_HIVEMIND (Debian's "
                     "libopendht-dev, libsodium-dev, libasio-dev, libmsgpack-cxx-dev; scripts/setup.sh installs them)");
#endif
  throw InputError("trainer.env_type: unknown value '" + type +
                   "' (expected pytorch, pytorchDDP, deepspeed, deepspeed+mpu or hivemind)");
}

}  // namespace polytrain
