// env_type=pytorchDDP: every rank holds the whole model; gradients are averaged over ranks
// every optimizer step. Gradients live in flat buckets (reverse registration order, about
// trainer.reduce_bucket_size bytes each) that the parameters' .grad tensors are views of;
// a post-hook on each parameter's gradient accumulator starts a bucket's async all_reduce
// as soon as its last gradient is in, so communication overlaps the rest of backward
// (PyTorch DDP's Reducer design, Li et al., VLDB 2020). Micro-steps before the accumulation
// boundary communicate nothing. Sharding of data by rank is the Trainer's (dp_rank/dp_size).
#pragma once

#include <memory>
#include <vector>

#include "parallel/backend.h"
#include "parallel/comm/communicator.h"

namespace polytrain {

class DdpBackend : public Backend {
 public:
  /// Uses `comm` when given (tests), else the communicator of the launcher's environment.
  explicit DdpBackend(const Config& cfg, std::unique_ptr<Communicator> comm = nullptr);
  ~DdpBackend() override;
  std::string name() const override { return "pytorchDDP"; }
  const RankContext& context() const override { return ctx_; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  bool ready_to_step(int64_t micro_steps_done) const override;
  void backward(const at::Tensor& loss) override;
  StepResult step(double lr, std::optional<double> beta1, double loss_scale) override;
  double reduce_metric(double local_value) override;
  void save_state(torch::serialize::OutputArchive& archive) override;
  void load_state(torch::serialize::InputArchive& archive) override;
  torch::optim::Optimizer& optimizer() override;

  Communicator& communicator() { return *comm_; }
  size_t bucket_count() const { return buckets_.size(); }
  /// Seconds step() spent waiting for all-reduces not yet finished (exposed communication).
  double exposed_comm_seconds() const { return exposed_comm_seconds_; }

  /// Called by the gradient hook of parameter `index` once its gradient is accumulated.
  void on_grad_ready(size_t index);

 private:
  struct Bucket {
    at::Tensor buffer;            ///< flat gradients of its parameters
    std::vector<size_t> params;   ///< indices into params_
    size_t pending = 0;           ///< gradients not yet ready in this backward
    std::unique_ptr<CommWork> work;
  };
  void launch(Bucket& b);

  RankContext ctx_;
  std::unique_ptr<Communicator> comm_;
  int64_t accumulation_steps_ = 1;
  int64_t micro_ = 0;
  bool sync_now_ = false;
  double clip_ = 0.0;
  int64_t bucket_bytes_ = 25000000;
  bool overlap_ = true;
  bool find_unused_ = false;
  double exposed_comm_seconds_ = 0.0;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<size_t> bucket_of_;
  std::vector<char> ready_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<void>> accumulators_;  ///< keep the hooked nodes alive
};

}  // namespace polytrain
