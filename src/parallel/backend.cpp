// Backend's defaults: the data shard of a fixed data-parallel world, and the consolidated
// model of a backend whose ranks each hold the whole model.
#include "polytrain/parallel/backend.h"

#include <torch/nn/module.h>

#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/error.h"

namespace polytrain {

DataShard Backend::data_shard() const {
  const auto& c = context();
  return DataShard{c.dp_rank, c.dp_size, false};
}

void Backend::run_micro_batches(MicroBatchRunner& runner) {
  int64_t m = 0, samples = 0;
  for (int64_t n; (n = next_micro_batch(m, samples)) > 0; ++m) {
    const at::Tensor loss = runner.forward(n);
    const bool last = next_micro_batch(m + 1, samples + n) == 0;
    backward(loss, MicroStep{n, last});
    samples += n;
  }
}

std::map<std::string, at::Tensor> MicroBatchRunner::read(int64_t) {
  throw InternalError("this micro-batch runner cannot feed a pipeline schedule");
}

at::Tensor MicroBatchRunner::weigh(const at::Tensor&, int64_t) {
  throw InternalError("this micro-batch runner cannot feed a pipeline schedule");
}

at::Tensor Backend::eval_forward(const std::map<std::string, at::Tensor>&) {
  throw InternalError(name() + " runs no pipeline");
}

int64_t Backend::assist(int64_t step, int64_t until) {
  PT_INPUT_CHECK(false, name(), " has no auxiliary peers (hivemind.assist_in_averaging is env_type hivemind's)");
  (void)until;
  return step;
}

NamedTensors Backend::full_state(torch::nn::Module& model) { return module_state(model); }

void Backend::load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) {
  load_module_state(model, state, origin);
}

}  // namespace polytrain
