// NCCL has every collective natively (avg since NCCL 2.10, bf16, flat reduce-scatter and
// all-gather), so nothing here falls back. Timeouts: c10d enforces options->timeout only in
// "blocking wait" mode, which is switched on (unless the user set it) so that a stuck
// collective fails in wait() naming the rank and operation instead of hanging.
// Point-to-point is c10d's send/recv (ncclSend/ncclRecv on a communicator c10d makes per pair
// of ranks the first time they talk). NCCL has no tags: the tag is checked, then ignored, and
// a pair's messages match in the order they are posted on each side. Tensors travel as their
// raw bytes, so any dtype goes bit-exact.
#include "polytrain/parallel/comm/nccl_communicator.h"

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif

#include <cstdlib>
#include <functional>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/rendezvous.h"

namespace polytrain {
namespace {

using detail::cat;

class NoWork : public CommWork {
 public:
  void wait() override {}
};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg: return c10d::ReduceOp::AVG;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    default: return c10d::ReduceOp::SUM;
  }
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                   std::string name)
      : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout), name_(std::move(name)) {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank, size, opts);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "nccl"; }

  std::unique_ptr<CommWork> all_reduce_async(at::Tensor& t, ReduceOp op) override {
    if (t.numel() == 0) return std::make_unique<NoWork>();
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    return wrap(pg_->allreduce(v, o), "all_reduce");
  }
  std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    PT_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input has ", in.numel(), " elements, expected ",
             out.numel(), " x ", size_);
    if (out.numel() == 0) return std::make_unique<NoWork>();
    at::Tensor src = in.contiguous();
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(op);
    return wrap(pg_->_reduce_scatter_base(out, src, o), "reduce_scatter");
  }
  std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) override {
    PT_CHECK(out.numel() == in.numel() * size_, "all_gather: output has ", out.numel(), " elements, expected ",
             in.numel(), " x ", size_);
    if (in.numel() == 0) return std::make_unique<NoWork>();
    at::Tensor src = in.contiguous();
    return wrap(pg_->_allgather_base(out, src), "all_gather");
  }
  std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) override {
    if (t.numel() == 0) return std::make_unique<NoWork>();
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return wrap(pg_->broadcast(v, o), cat("broadcast from rank ", root));
  }
  std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) override {
    if (t.numel() == 0) return std::make_unique<NoWork>();
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions o;
    o.reduceOp = to_c10d(op);
    o.rootRank = root;
    return wrap(pg_->reduce(v, o), cat("reduce to rank ", root));
  }
  void barrier() override { wrap(pg_->barrier(), "barrier")->wait(); }

  std::unique_ptr<CommWork> send_async(const at::Tensor& t, int dst, int tag) override {
    check_p2p(t, dst, tag, "send");
    if (t.numel() == 0) return std::make_unique<NoWork>();  // the receiver skips it too
    std::vector<at::Tensor> v{t.reshape({-1}).view(at::kByte)};
    return wrap(pg_->send(v, dst, tag), cat("send to rank ", dst, " (tag ", tag, ")"));
  }
  std::unique_ptr<CommWork> recv_async(at::Tensor& t, int src, int tag) override {
    check_p2p(t, src, tag, "recv");
    if (t.numel() == 0) return std::make_unique<NoWork>();
    std::vector<at::Tensor> v{t.reshape({-1}).view(at::kByte)};
    return wrap(pg_->recv(v, src, tag), cat("recv from rank ", src, " (tag ", tag, ")"));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const SplitPlace place = split_place(*this, color, key, c10::Device(c10::kCUDA));
    const std::string prefix = cat(name_, "/split", splits_++, "/color", color);
    return std::make_unique<NcclCommunicator>(c10::make_intrusive<c10d::PrefixStore>(prefix, store_), place.rank,
                                              place.size, timeout_, prefix);
  }

 private:
  std::unique_ptr<CommWork> wrap(c10::intrusive_ptr<c10d::Work> work, const std::string& op) {
    return std::make_unique<C10dWork>(std::move(work), cat("nccl ", op, " on rank ", rank_, " of ", size_));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  int splits_ = 0;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, const std::string& addr, int port,
                                                     std::chrono::milliseconds timeout) {
  PT_INPUT_CHECK(torch::cuda::is_available(), "nccl: no CUDA device is visible to rank ", rank);
  // Blocking wait makes options->timeout apply to wait() (file comment). LibTorch 2.2 renamed
  // the variable (and warns about the old name).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  if (!std::getenv("NCCL_BLOCKING_WAIT")) setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
#else
  setenv("NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
#endif
  auto store = rendezvous_store("nccl", rank, size, addr, port, timeout);
  return std::make_unique<NcclCommunicator>(store, rank, size, timeout, "world");
}

}  // namespace polytrain
