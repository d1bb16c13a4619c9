// Backend's defaults: the data shard of a fixed data-parallel world, and the consolidated
// model of a backend whose ranks each hold the whole model.
#include "polytrain/parallel/backend.h"

#include <torch/nn/module.h>

#include "polytrain/trainer/checkpoint.h"

namespace polytrain {

DataShard Backend::data_shard() const {
  const auto& c = context();
  return DataShard{c.dp_rank, c.dp_size, false};
}

NamedTensors Backend::full_state(torch::nn::Module& model) { return module_state(model); }

void Backend::load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) {
  load_module_state(model, state, origin);
}

}  // namespace polytrain
