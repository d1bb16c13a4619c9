// libtorch 1.13's Gloo process group has allreduce (sum, max; no avg), allgather (list form
// only: no _allgather_base), broadcast and barrier, for float/double/half/integer tensors.
// What it lacks, and the fallback used here:
//   - avg: sum, then divide by the group size;
//   - bf16 (and other unsupported types): the collective runs on an fp32 copy, the result is
//     rounded back once (a sum in fp32 is also more accurate than one in bf16);
//   - reduce_scatter: one `reduce` per rank on its block of a copy of the input (a block's
//     owner receives it; an all_reduce of everything would move twice the bytes);
//   - flat all_gather: each rank's block is broadcast in place from its owner (measured on
//     loopback, 64 MiB over 2 ranks: 29 ms, against 844 ms for Gloo's list allgather).
// Point-to-point is c10d's send/recv (a Gloo unbound buffer; the tag is its slot, which
// collectives never use: theirs carry a prefix in the high bits). Gloo moves raw bytes, so every
// dtype travels as a byte view of the tensor, bf16 bit-exact. No timeout of c10d's own: its
// wait() leaves Gloo's waitSend/waitRecv at the context's, which is the group's timeout; a
// peer gone or silent past it fails wait() with a CommFailure, as the collectives do.
#include "polytrain/parallel/comm/gloo_communicator.h"

// c10d declares ProcessGroupGloo only when this is set (libtorch's own build sets it).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif

#include <functional>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/comm_failure.h"
#include "polytrain/parallel/comm/rendezvous.h"

namespace polytrain {
namespace {

using detail::cat;

bool gloo_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kChar:
    case at::kByte:
      return true;
    default:
      return false;
  }
}

class DoneWork : public CommWork {
 public:
  explicit DoneWork(std::function<void()> then = {}) : then_(std::move(then)) {}
  void wait() override {
    if (then_) std::exchange(then_, {})();
  }

 private:
  std::function<void()> then_;
};

// Several collectives that finish as one (a fallback made of per-rank operations).
class ManyWork : public CommWork {
 public:
  ManyWork(std::vector<std::unique_ptr<CommWork>> parts, std::function<void()> then)
      : parts_(std::move(parts)), then_(std::move(then)) {}
  void wait() override {
    for (auto& p : parts_) p->wait();
    parts_.clear();
    if (then_) std::exchange(then_, {})();
  }

 private:
  std::vector<std::unique_ptr<CommWork>> parts_;
  std::function<void()> then_;
};

// The bytes of a contiguous, non-empty tensor as a flat uint8 view of its storage (a recv writes
// through it).
at::Tensor byte_view(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

c10d::ReduceOp to_c10d(ReduceOp op) {
  return op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                   std::shared_ptr<::gloo::transport::Device> device, std::string name)
      : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout), device_(std::move(device)),
        name_(std::move(name)) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(device_);
    opts->threads = 2;
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, size, opts);
      // A member's constructor returns once its own pairs are connected, not every member's: one
      // that goes on to fail (a config error every rank raises) and exits would close its
      // sockets under a member still handshaking, which then reports a lost connection instead
      // of the error. Nobody leaves before every member is connected.
      pg_->barrier()->wait();
    } catch (const std::exception& e) {
      std::string msg = e.what();
      if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
      throw Error(cat("gloo: rank ", rank, " of ", size, " could not connect its group (", name_, "): ", msg));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "gloo"; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::shared_ptr<::gloo::transport::Device>& device() const { return device_; }

  std::unique_ptr<CommWork> all_reduce_async(at::Tensor& t, ReduceOp op) override {
    PT_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor");
    if (t.numel() == 0) return std::make_unique<DoneWork>();
    at::Tensor buf = gloo_dtype(t.scalar_type()) ? t : t.to(at::kFloat);
    std::vector<at::Tensor> v{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto work = pg_->allreduce(v, o);
    const int n = size_;
    return wrap(work, "all_reduce", [t, buf, op, n]() mutable {
      if (op == ReduceOp::kAvg) buf.div_(n);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    PT_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input has ", in.numel(), " elements, expected ",
             out.numel(), " x ", size_);
    const int64_t n = out.numel();
    if (n == 0) return std::make_unique<DoneWork>();
    // Fallback (file comment): a copy of the input (reduce uses it as scratch), one reduce per block.
    at::Tensor whole = in.to(gloo_dtype(in.scalar_type()) ? in.scalar_type() : at::kFloat, false, true).contiguous();
    whole = whole.view({-1});
    std::vector<std::unique_ptr<CommWork>> parts;
    for (int r = 0; r < size_; ++r) {
      at::Tensor block = whole.narrow(0, r * n, n);
      parts.push_back(reduce_async(block, r, op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum));
    }
    const int size = size_, r = rank_;
    return std::make_unique<ManyWork>(std::move(parts), [out, whole, op, n, size, r]() mutable {
      auto mine = whole.narrow(0, r * n, n);
      if (op == ReduceOp::kAvg) mine.div_(size);
      out.view({-1}).copy_(mine);
    });
  }

  std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) override {
    PT_CHECK(out.numel() == in.numel() * size_, "all_gather: output has ", out.numel(), " elements, expected ",
             in.numel(), " x ", size_);
    PT_CHECK(out.is_contiguous(), "all_gather needs a contiguous output");
    const int64_t n = in.numel();
    if (n == 0) return std::make_unique<DoneWork>();
    // Fallback (file comment): this rank's block copied in place, every block broadcast by its owner.
    const bool native = gloo_dtype(in.scalar_type()) && in.scalar_type() == out.scalar_type();
    at::Tensor dst = native ? out.view({-1}) : at::empty({out.numel()}, in.options().dtype(at::kFloat));
    dst.narrow(0, rank_ * n, n).copy_(in.reshape({-1}));
    std::vector<std::unique_ptr<CommWork>> parts;
    for (int r = 0; r < size_; ++r) {
      at::Tensor block = dst.narrow(0, r * n, n);
      parts.push_back(broadcast_async(block, r));
    }
    return std::make_unique<ManyWork>(std::move(parts), [out, dst, native]() mutable {
      if (!native) out.view({-1}).copy_(dst);
    });
  }

  std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) override {
    PT_CHECK(t.is_contiguous(), "broadcast needs a contiguous tensor");
    if (t.numel() == 0) return std::make_unique<DoneWork>();
    at::Tensor buf = gloo_dtype(t.scalar_type()) ? t : t.to(at::kFloat);
    std::vector<at::Tensor> v{buf};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    auto work = pg_->broadcast(v, o);
    return wrap(work, cat("broadcast from rank ", root), [t, buf]() mutable {
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) override {
    PT_CHECK(t.is_contiguous(), "reduce needs a contiguous tensor");
    if (t.numel() == 0) return std::make_unique<DoneWork>();
    at::Tensor buf = gloo_dtype(t.scalar_type()) ? t : t.to(at::kFloat);
    std::vector<at::Tensor> v{buf};
    c10d::ReduceOptions o;
    o.reduceOp = to_c10d(op);
    o.rootRank = root;
    auto work = pg_->reduce(v, o);
    const int n = size_;
    const bool at_root = rank_ == root;
    return wrap(work, cat("reduce to rank ", root), [t, buf, op, n, at_root]() mutable {
      if (!at_root) return;
      if (op == ReduceOp::kAvg) buf.div_(n);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  void barrier() override { wrap(pg_->barrier(), "barrier", {})->wait(); }

  std::unique_ptr<CommWork> send_async(const at::Tensor& t, int dst, int tag) override {
    check_p2p(t, dst, tag, "send");
    // Nothing to move; the receiver knows the size too and skips as well.
    if (t.numel() == 0) return std::make_unique<DoneWork>();
    std::vector<at::Tensor> v{byte_view(t)};
    return wrap(pg_->send(v, dst, tag), cat("send to rank ", dst, " (tag ", tag, ")"), {});
  }

  std::unique_ptr<CommWork> recv_async(at::Tensor& t, int src, int tag) override {
    check_p2p(t, src, tag, "recv");
    if (t.numel() == 0) return std::make_unique<DoneWork>();
    std::vector<at::Tensor> v{byte_view(t)};
    return wrap(pg_->recv(v, src, tag), cat("recv from rank ", src, " (tag ", tag, ")"), {});
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const SplitPlace place = split_place(*this, color, key, c10::Device(c10::kCPU));
    const std::string prefix = cat(name_, "/split", splits_++, "/color", color);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
    return std::make_unique<GlooCommunicator>(store, place.rank, place.size, timeout_, device_, prefix);
  }

 private:
  std::unique_ptr<CommWork> wrap(c10::intrusive_ptr<c10d::Work> work, const std::string& op,
                                 std::function<void()> then) {
    return std::make_unique<C10dWork>(std::move(work), cat("gloo ", op, " on rank ", rank_, " of ", size_), std::move(then),
                                      /*wait_on_destroy=*/true);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::string name_;
  int splits_ = 0;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

bool loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0; }

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

namespace {

GlooGroupFactory group_factory(c10::intrusive_ptr<c10d::Store> store, std::shared_ptr<::gloo::transport::Device> device,
                               std::chrono::milliseconds timeout) {
  return [store, device, timeout](const std::string& name, int rank, int size) -> std::unique_ptr<Communicator> {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
    return std::make_unique<GlooCommunicator>(prefixed, rank, size, timeout, device, name);
  };
}

StoreOps store_ops(c10::intrusive_ptr<c10d::Store> store) {
  // A store call that fails means its host (rank 0's process) is gone: there is no quorum.
  auto guarded = [](const char* what, auto&& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      throw CommFailure(cat("the rendezvous store (hosted by rank 0's process) did not answer a ", what, ": ",
                            first_line(e)));
    }
  };
  StoreOps ops;
  ops.set = [store, guarded](const std::string& k, const std::string& v) {
    guarded("set", [&] { store->set(k, as_bytes(v)); return 0; });
  };
  ops.has = [store, guarded](const std::string& k) { return guarded("check", [&] { return store->check({k}); }); };
  ops.set_once = [store, guarded](const std::string& k, const std::string& v) {
    return guarded("compare-and-set", [&] { return as_string(store->compareSet(k, {}, as_bytes(v))); });
  };
  ops.get = [store, guarded](const std::string& k) { return guarded("get", [&] { return as_string(store->get(k)); }); };
  return ops;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (loopback(addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

GlooGroupFactory gloo_group_factory(Communicator& world) {
  auto* g = dynamic_cast<GlooCommunicator*>(&world);
  if (!g) return {};
  return group_factory(g->store(), g->device(), g->timeout());
}

StoreOps gloo_store_ops(Communicator& world) {
  auto* g = dynamic_cast<GlooCommunicator*>(&world);
  if (!g) return {};
  return store_ops(g->store());
}

GlooRendezvous gloo_rendezvous_client(int rank, int size, const std::string& addr, int port,
                                      std::chrono::milliseconds timeout) {
  PT_INPUT_CHECK(rank > 0, "fault tolerance: rank 0 hosts the rendezvous store and cannot be replaced");
  auto store = rendezvous_store("gloo", rank, size, addr, port, timeout);
  return GlooRendezvous{group_factory(store, gloo_device(addr), timeout), store_ops(store)};
}

std::unique_ptr<Communicator> make_gloo_communicator(int rank, int size, const std::string& addr, int port,
                                                     std::chrono::milliseconds timeout) {
  auto store = rendezvous_store("gloo", rank, size, addr, port, timeout);
  return std::make_unique<GlooCommunicator>(store, rank, size, timeout, gloo_device(addr), "world");
}

}  // namespace polytrain
