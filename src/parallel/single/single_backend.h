// env_type=pytorch: one process on the CPU or one CUDA device. No communication; the
// reference every other backend's loss trajectory is compared against.
#pragma once

#include "polytrain/parallel/replicated_backend.h"

namespace polytrain {

class SingleBackend : public ReplicatedBackend {
 public:
  explicit SingleBackend(const Config& cfg);
  std::string name() const override { return "pytorch"; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override { build(std::move(model), cfg); }
  void backward(const at::Tensor& loss, const MicroStep& m) override;
  StepResult step(const StepRequest& request, int64_t step) override;
  double reduce_metric(double local_value) override { return local_value; }
  void barrier() override {}
};

}  // namespace polytrain
