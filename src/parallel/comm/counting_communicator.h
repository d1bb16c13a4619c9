// A Communicator that forwards to another and counts the bytes each rank puts into
// collectives, in the ZeRO paper's convention (Rajbhandari et al. 2020, section 7): an
// all-reduce of n bytes counts 2n (a reduce-scatter plus an all-gather), a reduce,
// reduce-scatter or broadcast of n bytes counts n, an all-gather counts its output. So DDP's
// step is 2 x the gradient bytes, and ZeRO's reductions plus its parameter gather are too.
// Point-to-point counts the bytes a rank sends (p2p_bytes), not those it receives: summed over
// the ranks, each message counts once.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string engine() const override { return inner_->engine(); }
  std::unique_ptr<CommWork> all_reduce_async(at::Tensor& t, ReduceOp op) override {
    all_reduce_bytes += 2 * bytes(t);
    return inner_->all_reduce_async(t, op);
  }
  std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    reduce_bytes += bytes(in);
    return inner_->reduce_scatter_async(out, in, op);
  }
  std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) override {
    gather_bytes += bytes(out);
    return inner_->all_gather_async(out, in);
  }
  std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) override {
    gather_bytes += bytes(t);
    return inner_->broadcast_async(t, root);
  }
  std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) override {
    reduce_bytes += bytes(t);
    return inner_->reduce_async(t, root, op);
  }
  std::unique_ptr<CommWork> send_async(const at::Tensor& t, int dst, int tag) override {
    p2p_bytes += bytes(t);
    return inner_->send_async(t, dst, tag);
  }
  std::unique_ptr<CommWork> recv_async(at::Tensor& t, int src, int tag) override {
    return inner_->recv_async(t, src, tag);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::make_unique<CountingCommunicator>(inner_->split(color, key));
  }
  int64_t total() const { return all_reduce_bytes + reduce_bytes + gather_bytes + p2p_bytes; }
  void reset() { all_reduce_bytes = reduce_bytes = gather_bytes = p2p_bytes = 0; }

  std::atomic<int64_t> all_reduce_bytes{0};  ///< counted 2x (see the file comment)
  std::atomic<int64_t> reduce_bytes{0};      ///< reduce and reduce_scatter
  std::atomic<int64_t> gather_bytes{0};      ///< broadcast and all_gather
  std::atomic<int64_t> p2p_bytes{0};         ///< send (receives are the senders' bytes)

 private:
  static int64_t bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
  std::unique_ptr<Communicator> inner_;
};

}  // namespace polytrain
