// env_type=pytorchDDP: every rank holds the whole model; gradients are averaged over ranks
// every optimizer step. Gradients live in GradBuckets (flat buffers the .grad tensors are views
// of); when the last gradient of a bucket is in during the boundary micro-step's backward,
// that bucket's async all_reduce starts, so communication overlaps the rest of backward
// (PyTorch DDP's Reducer design). Micro-steps before the boundary communicate nothing.
#pragma once

#include <memory>
#include <vector>

#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/grad_buckets.h"
#include "polytrain/parallel/replicated_backend.h"

namespace polytrain {

class DdpBackend : public ReplicatedBackend {
 public:
  /// Uses `comm` when given (tests), else the communicator of the launcher's environment.
  explicit DdpBackend(const Config& cfg, std::unique_ptr<Communicator> comm = nullptr);
  ~DdpBackend() override;
  std::string name() const override { return "pytorchDDP"; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override;
  void backward(const at::Tensor& loss, const MicroStep& m) override;
  StepResult step(const StepRequest& request, int64_t step) override;
  double reduce_metric(double local_value) override;
  void barrier() override { comm_->barrier(); }
  std::string share(const std::string& value) override;

  size_t bucket_count() const { return buckets_ ? buckets_->size() : 0; }
  /// Seconds step() spent waiting for all-reduces not yet finished (exposed communication).
  double exposed_comm_seconds() const { return exposed_comm_seconds_; }

 private:
  void launch(size_t bucket);

  std::unique_ptr<Communicator> comm_;
  int64_t bucket_bytes_ = 25000000;
  bool overlap_ = true;
  bool find_unused_ = false;
  double exposed_comm_seconds_ = 0.0;
  std::unique_ptr<GradBuckets> buckets_;
  std::vector<std::unique_ptr<CommWork>> work_;  ///< per bucket, while its all_reduce runs
};

}  // namespace polytrain
