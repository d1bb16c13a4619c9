#include "parallel/ddp/ddp_backend.h"

#include <chrono>
#include <cmath>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "common/dist_env.h"
#include "common/error.h"
#include "parallel/single/single_backend.h"
#include "trainer/optimizers.h"

namespace polytrain {
namespace {

using detail::cat;

// Post-hook of a parameter's AccumulateGrad node: runs after the gradient is added to .grad.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(DdpBackend* owner, size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    owner_->on_grad_ready(index_);
    return outputs;
  }
  DdpBackend* owner_;
  size_t index_;
};

}  // namespace

DdpBackend::DdpBackend(const Config& cfg, std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {
  const auto& t = cfg.trainer;
  ctx_.device = parse_device(t.pytorch_device);
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
  if (ctx_.device.is_cuda() && !ctx_.device.has_index()) {
    ctx_.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  }
  accumulation_steps_ = cfg.batch.gradient_accumulation_steps;
  clip_ = cfg.gradient_clipping;
  bucket_bytes_ = t.reduce_bucket_size;
  overlap_ = t.overlap_comm;
  find_unused_ = t.find_unused_parameters;
}

DdpBackend::~DdpBackend() {
  for (auto& b : buckets_) b.work.reset();  // waits for any collective still writing
}

void DdpBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  model_ = std::move(model);
  model_->to(ctx_.device);
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model_->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    named.emplace_back(item.key(), item.value());
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
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
  // Buckets in reverse registration order: roughly the order backward produces gradients.
  bucket_of_.assign(params_.size(), 0);
  ready_.assign(params_.size(), 0);
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = bucket_bytes_;
  at::ScalarType type = at::kFloat;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    if (groups.empty() || bytes >= bucket_bytes_ || p.scalar_type() != type) {
      groups.emplace_back();
      bytes = 0;
      type = p.scalar_type();
    }
    groups.back().push_back(k);
    bytes += p.numel() * p.element_size();
  }
  for (auto& g : groups) {
    Bucket b;
    int64_t numel = 0;
    for (size_t k : g) numel += params_[k].numel();
    b.buffer = torch::zeros({numel}, params_[g.front()].options().requires_grad(false));
    int64_t off = 0;
    for (size_t k : g) {
      auto& p = params_[k];
      // .grad is a view of the bucket: backward accumulates straight into what is reduced.
      p.mutable_grad() = b.buffer.narrow(0, off, p.numel()).view_as(p);
      off += p.numel();
      bucket_of_[k] = buckets_.size();
    }
    b.params = g;
    buckets_.push_back(std::move(b));
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    acc->add_post_hook(std::make_unique<GradReadyHook>(this, k));
    accumulators_.push_back(acc);
  }
  optimizer_ = make_optimizer(cfg.optimizer, named);
}

bool DdpBackend::ready_to_step(int64_t micro_steps_done) const { return micro_steps_done >= accumulation_steps_; }

void DdpBackend::backward(const at::Tensor& loss) {
  ++micro_;
  sync_now_ = micro_ % accumulation_steps_ == 0;  // only the boundary micro-step communicates
  if (sync_now_) {
    std::fill(ready_.begin(), ready_.end(), 0);
    for (auto& b : buckets_) b.pending = b.params.size();
  }
  loss.backward();
  if (sync_now_ && !overlap_) {
    for (auto& b : buckets_) launch(b);
  }
}

void DdpBackend::on_grad_ready(size_t index) {
  if (!sync_now_ || ready_[index]) return;
  ready_[index] = 1;
  Bucket& b = buckets_[bucket_of_[index]];
  if (--b.pending == 0 && overlap_) launch(b);
}

void DdpBackend::launch(Bucket& b) {
  if (!b.work) b.work = comm_->all_reduce_async(b.buffer, ReduceOp::kAvg);
}

StepResult DdpBackend::step(double lr, std::optional<double> beta1, double loss_scale) {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_) {
    if (!b.work && b.pending > 0 && !find_unused_) {
      for (size_t k : b.params) {
        if (!ready_[k]) {
          throw InputError(cat("pytorchDDP: parameter '", names_[k], "' received no gradient in this step on rank ",
                               ctx_.rank, "; set trainer.find_unused_parameters to true if that is intended"));
        }
      }
    }
    launch(b);  // with find_unused_parameters: the unused gradients are zeros, averaged as such
  }
  for (auto& b : buckets_) {
    b.work->wait();
    b.work.reset();
  }
  exposed_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Identical gradients on every rank: the same norm, the same skip decision everywhere.
  const StepResult result = apply_update(params_, *optimizer_, clip_, lr, beta1, loss_scale);
  for (auto& b : buckets_) b.buffer.zero_();  // never set_to_none: .grad must stay a bucket view
  return result;
}

double DdpBackend::reduce_metric(double local_value) {
  // On the communicator's device: NCCL takes CUDA tensors only.
  auto t = torch::tensor({local_value}, torch::kDouble).to(ctx_.device);
  comm_->all_reduce(t, ReduceOp::kAvg);
  return t.item<double>();
}

void DdpBackend::save_state(torch::serialize::OutputArchive& archive) { save_optimizer_state(*optimizer_, archive); }

void DdpBackend::load_state(torch::serialize::InputArchive& archive) { load_optimizer_state(*optimizer_, archive); }

torch::optim::Optimizer& DdpBackend::optimizer() {
  PT_CHECK(optimizer_, "prepare() was not called");
  return *optimizer_;
}

}  // namespace polytrain
