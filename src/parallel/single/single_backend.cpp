// SingleBackend: the world is this process.
#include "polytrain/parallel/single/single_backend.h"

#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {

SingleBackend::SingleBackend(const Config& cfg) : ReplicatedBackend(cfg) {
  const int world = read_dist_env().world_size;
  PT_INPUT_CHECK(world == 1, "trainer.env_type: 'pytorch' runs one process, but this is one of ", world,
                 " (WORLD_SIZE); use pytorchDDP to train data-parallel");
}

void SingleBackend::backward(const at::Tensor& loss, const MicroStep& /*m*/) { loss.backward(); }

StepResult SingleBackend::step(const StepRequest& request, int64_t step) {
  StepResult r = update(request, step);
  zero_grads();
  return r;
}

}  // namespace polytrain
