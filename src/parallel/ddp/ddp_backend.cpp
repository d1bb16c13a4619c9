// DdpBackend: rank 0's weights broadcast at prepare, bucketed all-reduce (average) started from
// gradient hooks on the boundary micro-step, then the shared update on identical gradients.
#include "polytrain/parallel/ddp/ddp_backend.h"

#include <chrono>

#include <torch/nn/module.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/parallel/comm/rank_ops.h"

namespace polytrain {

using detail::cat;

DdpBackend::DdpBackend(const Config& cfg, std::unique_ptr<Communicator> comm)
    : ReplicatedBackend(cfg), comm_(std::move(comm)) {
  const auto& t = cfg.trainer;
  if (!comm_) comm_ = world_communicator(t, ctx_.device);
  set_data_parallel_context(ctx_, *comm_);
  bucket_bytes_ = t.reduce_bucket_size;
  overlap_ = t.overlap_comm;
  find_unused_ = t.find_unused_parameters;
}

DdpBackend::~DdpBackend() {
  for (auto& w : work_) w.reset();  // waits for any collective still writing
}

void DdpBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  // Every rank starts from rank 0's weights, broadcast before build() so that amp's fp32
  // master weights are copies of rank 0's too.
  model->to(ctx_.device);
  broadcast_module_state(*comm_, *model);
  build(std::move(model), cfg);
  buckets_ = std::make_unique<GradBuckets>(params_, names_, bucket_bytes_, [this](size_t b) {
    if (overlap_) launch(b);
  });
  work_.resize(buckets_->size());
}

void DdpBackend::backward(const at::Tensor& loss, const MicroStep& m) {
  if (m.sync) buckets_->arm();  // only the boundary micro-step communicates
  loss.backward();
  if (m.sync && !overlap_) {
    for (size_t b = 0; b < buckets_->size(); ++b) launch(b);
  }
}

void DdpBackend::launch(size_t b) {
  if (!work_[b]) work_[b] = comm_->all_reduce_async(buckets_->bucket(b).buffer, ReduceOp::kAvg);
  fault_point("allreduce");
}

StepResult DdpBackend::step(const StepRequest& request, int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t b = 0; b < buckets_->size(); ++b) {
    if (!work_[b] && !find_unused_) {
      const auto missing = buckets_->missing(b);
      if (!missing.empty()) {
        throw InputError(cat("pytorchDDP: parameter '", missing.front(), "' received no gradient in this step on rank ",
                             ctx_.rank, "; set trainer.find_unused_parameters to true if that is intended"));
      }
    }
    launch(b);  // with find_unused_parameters: the unused gradients are zeros, averaged as such
  }
  for (auto& w : work_) {
    w->wait();
    w.reset();
  }
  PT_INPUT_CHECK(buckets_->overfired().empty(), "pytorchDDP: parameter '", buckets_->overfired(),
                 "' received more gradient accumulations in this backward than in the first step, after its "
                 "bucket was all-reduced (the graph changed between steps); set trainer.overlap_comm to false");
  exposed_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Identical gradients on every rank: the same norm, the same skip decision everywhere.
  StepResult r = update(request, step);
  buckets_->zero();
  return r;
}

std::string DdpBackend::share(const std::string& value) { return share_from_rank0(*comm_, ctx_.device, value); }

double DdpBackend::reduce_metric(double local_value) { return mean_over_ranks(*comm_, ctx_.device, local_value); }

}  // namespace polytrain
