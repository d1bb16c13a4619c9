// GradBuckets: layout (reverse order, size cap, dtype breaks), .grad views, readiness hooks.
#include "polytrain/parallel/grad_buckets.h"

#include <algorithm>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

namespace polytrain {
namespace {

// Post-hook of a parameter's AccumulateGrad node: runs after the gradient is added to .grad.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(GradBuckets* owner, size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    owner_->grad_ready(index_);
    return outputs;
  }
  GradBuckets* owner_;
  size_t index_;
};

}  // namespace

GradBuckets::GradBuckets(std::vector<at::Tensor> params, std::vector<std::string> names, int64_t bucket_bytes,
                         std::function<void(size_t)> on_ready)
    : params_(std::move(params)), names_(std::move(names)), on_ready_(std::move(on_ready)) {
  bucket_of_.assign(params_.size(), 0);
  ready_.assign(params_.size(), 0);
  // Reverse registration order: roughly the order backward produces gradients.
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = bucket_bytes;
  at::ScalarType type = at::kFloat;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    if (groups.empty() || bytes >= bucket_bytes || p.scalar_type() != type) {
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
}

GradBuckets::~GradBuckets() = default;

void GradBuckets::arm() {
  armed_ = true;
  overfired_.clear();
  std::fill(ready_.begin(), ready_.end(), 0);
  fired_.assign(params_.size(), 0);
  for (auto& b : buckets_) {
    b.pending = 0;
    for (size_t k : b.params) b.pending += learned_ ? static_cast<size_t>(std::max(1, expected_[k])) : 1;
  }
}

void GradBuckets::grad_ready(size_t index) {
  if (!armed_) return;
  ready_[index] = 1;
  ++fired_[index];
  if (!learned_) return;  // first armed backward: counting only, the owner communicates after it
  const size_t b = bucket_of_[index];
  if (buckets_[b].pending == 0) {  // more accumulations than learned, after the bucket went out
    if (overfired_.empty()) overfired_ = names_[index];
    return;
  }
  if (--buckets_[b].pending == 0) on_ready_(b);
}

std::vector<std::string> GradBuckets::missing(size_t b) const {
  std::vector<std::string> out;
  for (size_t k : buckets_[b].params)
    if (!ready_[k]) out.push_back(names_[k]);
  return out;
}

void GradBuckets::zero() {
  for (auto& b : buckets_) b.buffer.zero_();
  if (armed_ && !learned_) {
    expected_ = fired_;
    learned_ = true;
  }
  armed_ = false;
}

}  // namespace polytrain
