// DdpBackend: rank 0's weights broadcast at prepare, bucketed all-reduce (average) started from
// gradient hooks on the boundary micro-step, then the shared update on identical gradients.
#include "polytrain/parallel/ddp/ddp_backend.h"

#include <chrono>
#include <cstring>
#include <map>

#include <torch/nn/module.h>
#include <torch/torch.h>

#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"

namespace polytrain {

using detail::cat;

DdpBackend::DdpBackend(const Config& cfg, std::unique_ptr<Communicator> comm)
    : ReplicatedBackend(cfg), comm_(std::move(comm)) {
  const auto& t = cfg.trainer;
  if (!comm_) {
    CommOptions o;
    o.engine = t.comm_backend;
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(t.comm_timeout * 1000));
    o.cuda = ctx_.device.is_cuda();
    comm_ = make_communicator(o);
  }
  const DistEnv env = read_dist_env();
  ctx_.rank = comm_->rank();
  ctx_.world_size = comm_->size();
  ctx_.local_rank = env.local_rank;
  ctx_.dp_rank = ctx_.rank;
  ctx_.dp_size = ctx_.world_size;
  ctx_.writes_logs = ctx_.writes_model = ctx_.commits_checkpoints = ctx_.rank == 0;
  if (ctx_.device.is_cuda() && !ctx_.device.has_index()) {
    ctx_.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  }
  bucket_bytes_ = t.reduce_bucket_size;
  overlap_ = t.overlap_comm;
  find_unused_ = t.find_unused_parameters;
}

DdpBackend::~DdpBackend() {
  for (auto& w : work_) w.reset();  // waits for any collective still writing
}

void DdpBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  build(std::move(model), cfg);
  // Every rank starts from rank 0's weights and buffers (one flat broadcast per dtype).
  {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> state;
    for (const auto& p : model_->parameters(true)) state.push_back(p);
    for (const auto& b : model_->buffers(true)) state.push_back(b);
    std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
    for (auto& t : state) by_type[t.scalar_type()].push_back(t);
    for (auto& [type, tensors] : by_type) {
      std::vector<at::Tensor> flat_parts;
      for (auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
      auto flat = torch::cat(flat_parts);
      comm_->broadcast(flat, 0);
      int64_t off = 0;
      for (auto& t : tensors) {
        t.copy_(flat.narrow(0, off, t.numel()).view_as(t));
        off += t.numel();
      }
    }
  }
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
  exposed_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Identical gradients on every rank: the same norm, the same skip decision everywhere.
  StepResult r = update(request, step);
  buckets_->zero();
  return r;
}

std::string DdpBackend::share(const std::string& value) {
  // Length, then bytes, from rank 0 (on the communicator's device: NCCL takes CUDA tensors).
  auto len = torch::tensor({static_cast<int64_t>(value.size())}, torch::kLong).to(ctx_.device);
  comm_->broadcast(len, 0);
  if (len.item<int64_t>() == 0) return std::string();
  auto bytes = torch::zeros({len.item<int64_t>()}, torch::kUInt8);
  if (ctx_.rank == 0) std::memcpy(bytes.data_ptr(), value.data(), value.size());
  bytes = bytes.to(ctx_.device);
  comm_->broadcast(bytes, 0);
  bytes = bytes.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

double DdpBackend::reduce_metric(double local_value) {
  // On the communicator's device: NCCL takes CUDA tensors only.
  auto t = torch::tensor({local_value}, torch::kDouble).to(ctx_.device);
  comm_->all_reduce(t, ReduceOp::kAvg);
  return t.item<double>();
}

}  // namespace polytrain
