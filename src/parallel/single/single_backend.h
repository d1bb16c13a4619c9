// env_type=pytorch: one process on the CPU or one CUDA device. No communication; the
// reference every other backend's loss trajectory is compared against.
#pragma once

#include "parallel/backend.h"

namespace polytrain {

class SingleBackend : public Backend {
 public:
  explicit SingleBackend(const Config& cfg);
  ~SingleBackend() override;
  std::string name() const override { return "pytorch"; }
  const RankContext& context() const override { return ctx_; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  bool ready_to_step(int64_t micro_steps_done) const override;
  void backward(const at::Tensor& loss) override;
  StepResult step(double lr, std::optional<double> beta1, double loss_scale) override;
  double reduce_metric(double local_value) override { return local_value; }
  void save_state(torch::serialize::OutputArchive& archive) override;
  void load_state(torch::serialize::InputArchive& archive) override;
  torch::optim::Optimizer& optimizer() override;

 private:
  RankContext ctx_;
  int64_t accumulation_steps_ = 1;
  double clip_ = 0.0;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<at::Tensor> params_;
};

/// Parses trainer.pytorch_device ("cpu", "cuda", "cuda:N"); InputError when CUDA is asked for
/// and not available.
c10::Device parse_device(const std::string& spec);

/// Global L2 norm of the gradients (of params with a gradient), as a double.
double grad_norm(const std::vector<at::Tensor>& params);

/// Scales every gradient by max_norm / norm when norm > max_norm (torch's clip_grad_norm_).
void clip_grads(const std::vector<at::Tensor>& params, double norm, double max_norm);

/// The update every replicated-parameter backend makes once gradients are final: global norm,
/// skip when it is not finite, clip to `clip` (0 = off), set lr (and beta1), optimizer step.
/// Gradients are left for the caller to clear.
StepResult apply_update(const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer, double clip,
                        double lr, std::optional<double> beta1, double loss_scale = 1.0);

/// The optimizer's state under the key "optimizer" of `archive`.
void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive);
void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive);

}  // namespace polytrain
