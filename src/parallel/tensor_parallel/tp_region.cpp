// f, g, scatter and gather along the last dim, and the vocab-parallel cross entropy. Each
// function is a torch::autograd::Function whose forward and backward run one collective on the
// tensor-parallel group; the Communicator travels as a pointer in saved_data.
#include "polytrain/parallel/tensor_parallel/tp_region.h"

#include <limits>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void put(AutogradContext* ctx, Communicator* comm) {
  ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
}
Communicator& get(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}

// A contiguous tensor the collective may overwrite (never the caller's own storage).
at::Tensor owned_copy(const at::Tensor& t) { return t.contiguous().clone(at::MemoryFormat::Contiguous); }

at::Tensor all_reduce_sum(Communicator& comm, const at::Tensor& t) {
  auto out = owned_copy(t);
  comm.all_reduce(out, ReduceOp::kSum);
  return out;
}

// Concatenation of every rank's `x` along the last dim.
at::Tensor gather_last(Communicator& comm, const at::Tensor& x) {
  const int64_t p = comm.size();
  auto in = x.contiguous();
  auto flat = at::empty({p * in.numel()}, in.options());
  comm.all_gather(flat, in);
  std::vector<int64_t> shape{p};
  for (auto s : in.sizes()) shape.push_back(s);
  // [p, ..., d] -> [..., p, d] -> [..., p * d]
  auto out = flat.view(shape).movedim(0, -2);
  auto sizes = in.sizes().vec();
  sizes.back() *= p;
  return out.reshape(sizes);
}

at::Tensor slice_last(Communicator& comm, const at::Tensor& x) {
  const int64_t p = comm.size(), d = x.size(-1);
  PT_CHECK(d % p == 0, "tensor parallel: last dim ", d, " is not divisible by ", p);
  return x.narrow(-1, comm.rank() * (d / p), d / p).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    put(ctx, comm);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_sum(get(ctx), g[0]), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, Communicator* comm) {
    return all_reduce_sum(*comm, x);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    put(ctx, comm);
    return gather_last(*comm, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {slice_last(get(ctx), g[0]), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    put(ctx, comm);
    return slice_last(*comm, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gather_last(get(ctx), g[0]), at::Tensor()};
  }
};

// Megatron's _VocabParallelCrossEntropy with torch's mean over labelled rows. In fp32 whatever
// the logits' dtype; the gradient returns in the logits' dtype.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels,
                            Communicator* comm, int64_t begin, int64_t valid, int64_t ignore_index) {
    PT_CHECK(logits.dim() == 2 && labels.dim() == 1 && logits.size(0) == labels.size(0),
             "vocab_cross_entropy: logits [N, V/p] and labels [N] expected, got ", logits.sizes(), " and ",
             labels.sizes());
    const int64_t cols = logits.size(1);
    auto x = logits.to(at::kFloat).contiguous();
    if (x.is_same(logits)) x = x.clone();
    if (valid < cols) x.narrow(1, valid, cols - valid).fill_(-std::numeric_limits<float>::infinity());
    // Global max per row (a rank whose rows are all padding contributes -inf).
    auto row_max = std::get<0>(x.max(1)).contiguous();
    comm->all_reduce(row_max, ReduceOp::kMax);
    x.sub_(row_max.unsqueeze(1));
    // The target's shifted logit, from the rank that owns it.
    auto owned = labels.ge(begin).logical_and(labels.lt(begin + valid));
    auto local_ids = (labels - begin).masked_fill(owned.logical_not(), 0);
    auto target = x.gather(1, local_ids.unsqueeze(1)).squeeze(1).masked_fill(owned.logical_not(), 0.0).contiguous();
    comm->all_reduce(target, ReduceOp::kSum);
    x.exp_();  // x is now exp(logit - max); padding columns are 0
    auto sum_exp = x.sum(1).contiguous();
    comm->all_reduce(sum_exp, ReduceOp::kSum);
    auto labelled = labels.ne(ignore_index);
    const auto count = labelled.sum().to(at::kFloat);
    auto per_row = (sum_exp.log() - target).masked_fill(labelled.logical_not(), 0.0);
    auto loss = per_row.sum() / count;  // NaN without labelled rows, as torch's cross_entropy
    x.div_(sum_exp.unsqueeze(1));       // softmax, kept for backward
    ctx->save_for_backward({x, local_ids, owned, labelled, count});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss.to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    const auto &local_ids = saved[1], &owned = saved[2], &labelled = saved[3], &count = saved[4];
    grad.scatter_add_(1, local_ids.unsqueeze(1), -owned.to(grad.scalar_type()).unsqueeze(1));
    auto row_scale = labelled.to(grad.scalar_type()) * (g[0].to(at::kFloat) / count);
    grad.mul_(row_scale.unsqueeze(1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class CommRegion : public TensorParallelRegion {
 public:
  explicit CommRegion(Communicator& comm) : comm_(&comm) {}
  int64_t rank() const override { return comm_->rank(); }
  int64_t size() const override { return comm_->size(); }
  // A group of one: every operator is the identity.
  at::Tensor copy_to(const at::Tensor& x) override { return size() == 1 ? x : CopyToRegion::apply(x, comm_); }
  at::Tensor reduce_from(const at::Tensor& x) override { return size() == 1 ? x : ReduceFromRegion::apply(x, comm_); }
  at::Tensor gather_last_dim(const at::Tensor& x) override {
    return size() == 1 ? x : GatherFromRegion::apply(x, comm_);
  }
  at::Tensor scatter_last_dim(const at::Tensor& x) override {
    return size() == 1 ? x : ScatterToRegion::apply(x, comm_);
  }
  at::Tensor vocab_cross_entropy(const at::Tensor& local_logits, const at::Tensor& labels, int64_t begin,
                                 int64_t valid, int64_t ignore_index) override {
    return VocabParallelCrossEntropy::apply(local_logits, labels, comm_, begin, valid, ignore_index);
  }

 private:
  Communicator* comm_;
};

}  // namespace

std::shared_ptr<TensorParallelRegion> make_tp_region(Communicator& group) {
  return std::make_shared<CommRegion>(group);
}

}  // namespace polytrain
