// MPI has every collective natively, non-blocking since MPI-3. Its gaps:
//   - no half/bf16 datatype: those tensors are reduced as an fp32 copy, rounded back once;
//   - no avg: sum, then divide by the group size;
//   - no timeout: wait() polls MPI_Test (which also drives progress) against a deadline and
//     fails naming the operation and rank; mpirun then stops the other ranks.
// A large all-reduce runs as a chain of segments, one after the other (2 MiB by default,
// POLYTRAIN_MPI_SEGMENT_BYTES; 0 = whole): each segment's reduction then works from cache
// instead of memory, 1.2-1.3x the bus bandwidth at 64 MB on 2 ranks here (docs/parallelism.md, "Collectives
// on one host"). MPI needs every rank to start its collectives on a communicator in the same
// order, so each communicator starts them from one queue, in call order: an operation starts
// only once every step of the ones before it has started.
// Point-to-point (MPI_Isend / MPI_Irecv of the raw bytes, any dtype bit-exact, with the tag) is
// not ordered against the collectives: it starts at once, as MPI's own non-blocking calls do,
// so a receive posted behind a collective still lets its sender finish. Its wait() drives the
// collective queue as well, the same polling against the same deadline.
#include "polytrain/parallel/comm/mpi_communicator.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"

namespace polytrain {
namespace {

using detail::cat;

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(cat("mpi ", what, " failed: ", std::string(msg, static_cast<size_t>(len))));
}

void ensure_initialized() {
  int done = 0;
  MPI_Initialized(&done);
  if (done) return;
  // Open MPI runs non-blocking collectives in libnbc, whose all-reduce for fewer than 4 ranks
  // is a binomial tree (each rank moves the whole buffer) whatever the size; its ring
  // (reduce-scatter, then all-gather: 2 (n-1)/n of it) reached 2.3-2.5x the bus bandwidth at
  // 16-64 MB on 2 ranks here (bench/ddp.sh). A value the user gives (environment, or mpirun's
  // --mca / -x, which arrive the same way) wins; other MPIs ignore the variable.
  setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  // Errors come back as return codes (turned into exceptions) rather than aborting the job.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  std::atexit([] {
    // MPI_Finalize waits for every rank; a rank that failed leaves without it, so that its
    // launcher (mpirun, or ours) sees it end and stops the others at once.
    if (exiting_after_error()) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
  });
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

int count_of(const at::Tensor& t) {
  PT_INPUT_CHECK(t.numel() <= INT_MAX, "mpi: a collective over ", t.numel(), " elements exceeds MPI's int count");
  return static_cast<int>(t.numel());
}

// Set once a collective timed out: a peer is gone or stuck, and no later collective can finish.
std::atomic<bool> g_peer_lost{false};

// One collective: the MPI calls that start its steps (one step, or a chain of segments), run in
// order, each once the one before it has completed.
struct Pending {
  std::deque<std::function<MPI_Request()>> steps;  // not started yet
  MPI_Request req = MPI_REQUEST_NULL;               // the step in flight
  bool done = false;
};

// A communicator's collectives in call order. progress() tests the steps in flight, starts the
// next step of an operation whose step completed, and starts an operation's first step only
// once every step of the operations before it has started (so all ranks start them in the
// same order, whatever their timing).
class OrderedQueue {
 public:
  std::shared_ptr<Pending> submit(std::deque<std::function<MPI_Request()>> steps) {
    auto p = std::make_shared<Pending>();
    p->steps = std::move(steps);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(p);
    }
    progress();
    return p;
  }
  void progress_ordered() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = ops_.begin(); it != ops_.end();) {
      Pending& p = **it;
      if (p.req != MPI_REQUEST_NULL) {
        int flag = 0;
        check(MPI_Test(&p.req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
        if (!flag) {
          if (!p.steps.empty()) return;  // its next step, and everything after it, wait
          ++it;
          continue;
        }
      }
      if (!p.steps.empty()) {
        p.req = p.steps.front()();
        p.steps.pop_front();
        continue;  // test it at once (small ones may be done)
      }
      p.done = true;
      it = ops_.erase(it);
    }
  }
  // A point-to-point operation: started now, outside the order (file comment); progress() tests it.
  std::shared_ptr<Pending> start_now(const std::function<MPI_Request()>& start) {
    auto p = std::make_shared<Pending>();
    std::lock_guard<std::mutex> lock(mu_);
    p->req = start();
    p2p_.push_back(p);
    return p;
  }
  void progress() {
    progress_ordered();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = p2p_.begin(); it != p2p_.end();) {
      int flag = 0;
      check(MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
      if (!flag) {
        ++it;
        continue;
      }
      (*it)->done = true;
      it = p2p_.erase(it);
    }
  }
  bool empty() {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_.empty();
  }

 private:
  std::mutex mu_;
  std::deque<std::shared_ptr<Pending>> ops_;
  std::vector<std::shared_ptr<Pending>> p2p_;
};

class MpiWork : public CommWork {
 public:
  MpiWork(std::shared_ptr<OrderedQueue> queue, std::shared_ptr<Pending> op, std::string what,
          std::chrono::milliseconds timeout, std::function<void()> then)
      : queue_(std::move(queue)), op_(std::move(op)), what_(std::move(what)), timeout_(timeout), then_(std::move(then)) {}
  ~MpiWork() override {
    // Its buffers must outlive the operation. Normally it has ended or ends within the deadline;
    // when a peer was lost (this one timed out, or another did: the error is on its way up),
    // MPI may still write into them, so they are left allocated and the request pending: the
    // process is about to exit, and waiting here would keep it from doing so.
    bool finished = op_->done;
    if (!finished && !g_peer_lost) {
      try {
        finished = finish_by(std::chrono::steady_clock::now() + timeout_);
      } catch (const std::exception&) {
        g_peer_lost = true;
      }
    }
    if (!finished) new std::function<void()>(std::move(then_));  // keeps the tensors alive
  }
  void wait() override {
    const bool lost_before = g_peer_lost;
    if (!finish_by(std::chrono::steady_clock::now() + timeout_)) {
      throw Error(lost_before ? cat(what_, " cannot finish: an earlier collective timed out (a rank is gone or stuck)")
                              : cat(what_, " timed out after ", timeout_.count() / 1000.0, " s"));
    }
    if (then_) std::exchange(then_, {})();
  }

 private:
  // Drives the queue until this operation completes (true) or the deadline passes (false; peer lost).
  bool finish_by(std::chrono::steady_clock::time_point deadline) {
    while (true) {
      queue_->progress();
      if (op_->done) return true;
      if (g_peer_lost || std::chrono::steady_clock::now() > deadline) {
        g_peer_lost = true;
        return false;
      }
      std::this_thread::yield();
    }
  }

  std::shared_ptr<OrderedQueue> queue_;
  std::shared_ptr<Pending> op_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::function<void()> then_;
};

// Bytes per all-reduce segment (POLYTRAIN_MPI_SEGMENT_BYTES; 0: never split).
int64_t segment_bytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("POLYTRAIN_MPI_SEGMENT_BYTES");
    return e && *e ? std::max<int64_t>(0, std::atoll(e)) : int64_t{2} << 20;
  }();
  return v;
}

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout) : comm_(comm), timeout_(timeout) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "mpi"; }

  std::unique_ptr<CommWork> all_reduce_async(at::Tensor& t, ReduceOp op) override {
    PT_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor");
    at::Tensor buf = native(t) ? t : t.to(at::kFloat);
    const int total = count_of(buf);
    const int64_t esize = buf.element_size();
    const int seg = segment_bytes() > 0 && total * esize > 2 * segment_bytes()
                        ? static_cast<int>(std::max<int64_t>(1, segment_bytes() / esize)) : total;
    std::deque<std::function<MPI_Request()>> steps;
    int off = 0;
    do {  // one step for an empty tensor too
      const int len = std::min(seg, total - off);
      steps.push_back([comm = comm_, buf, off, len, op, esize] {
        MPI_Request req;
        check(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(buf.data_ptr()) + off * esize, len,
                             mpi_type(buf.scalar_type()), mpi_op(op), comm, &req),
              "MPI_Iallreduce");
        return req;
      });
      off += seg;
    } while (off < total);
    const int n = size_;
    return work(std::move(steps), "all_reduce", [t, buf, op, n]() mutable {
      if (op == ReduceOp::kAvg) buf.div_(n);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    PT_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input has ", in.numel(), " elements, expected ",
             out.numel(), " x ", size_);
    PT_CHECK(out.is_contiguous(), "reduce_scatter needs a contiguous output");
    const bool nat = native(in);
    at::Tensor src = (nat ? in : in.to(at::kFloat)).contiguous();
    at::Tensor dst = nat && out.scalar_type() == in.scalar_type() ? out : at::empty({out.numel()}, src.options());
    const int count = count_of(out);
    const int n = size_;
    return work(one([comm = comm_, src, dst, count, op] {
                  MPI_Request req;
                  check(MPI_Ireduce_scatter_block(src.data_ptr(), dst.data_ptr(), count, mpi_type(src.scalar_type()),
                                                  mpi_op(op), comm, &req),
                        "MPI_Ireduce_scatter_block");
                  return req;
                }),
                "reduce_scatter", [out, dst, src, op, n]() mutable {
      if (op == ReduceOp::kAvg) dst.div_(n);
      if (!dst.is_same(out)) out.view({-1}).copy_(dst.view({-1}));
    });
  }

  std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) override {
    PT_CHECK(out.numel() == in.numel() * size_, "all_gather: output has ", out.numel(), " elements, expected ",
             in.numel(), " x ", size_);
    PT_CHECK(out.is_contiguous(), "all_gather needs a contiguous output");
    // Gathering moves bytes: any dtype travels as raw bytes, no conversion needed.
    at::Tensor src = in.contiguous();
    const int64_t bytes = src.numel() * src.element_size();
    PT_INPUT_CHECK(bytes <= INT_MAX, "mpi: all_gather of ", bytes, " bytes exceeds MPI's int count");
    return work(one([comm = comm_, src, out, bytes] {
                  MPI_Request req;
                  check(MPI_Iallgather(src.data_ptr(), static_cast<int>(bytes), MPI_BYTE, out.data_ptr(),
                                       static_cast<int>(bytes), MPI_BYTE, comm, &req),
                        "MPI_Iallgather");
                  return req;
                }),
                "all_gather", [src]() {});
  }

  std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) override {
    PT_CHECK(t.is_contiguous(), "broadcast needs a contiguous tensor");
    const int64_t bytes = t.numel() * t.element_size();
    PT_INPUT_CHECK(bytes <= INT_MAX, "mpi: broadcast of ", bytes, " bytes exceeds MPI's int count");
    return work(one([comm = comm_, t, bytes, root] {
                  MPI_Request req;
                  check(MPI_Ibcast(t.data_ptr(), static_cast<int>(bytes), MPI_BYTE, root, comm, &req), "MPI_Ibcast");
                  return req;
                }),
                cat("broadcast from rank ", root), [t]() {});
  }

  std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) override {
    PT_CHECK(t.is_contiguous(), "reduce needs a contiguous tensor");
    at::Tensor buf = native(t) ? t : t.to(at::kFloat);
    const bool at_root = rank_ == root;
    const int count = count_of(buf);
    const int n = size_;
    return work(one([comm = comm_, buf, at_root, count, op, root] {
                  MPI_Request req;
                  check(MPI_Ireduce(at_root ? MPI_IN_PLACE : buf.data_ptr(), buf.data_ptr(), count,
                                    mpi_type(buf.scalar_type()), mpi_op(op), root, comm, &req),
                        "MPI_Ireduce");
                  return req;
                }),
                cat("reduce to rank ", root), [t, buf, op, n, at_root]() mutable {
      if (!at_root) return;
      if (op == ReduceOp::kAvg) buf.div_(n);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  void barrier() override {
    work(one([comm = comm_] {
           MPI_Request req;
           check(MPI_Ibarrier(comm, &req), "MPI_Ibarrier");
           return req;
         }),
         "barrier", {})
        ->wait();
  }

  std::unique_ptr<CommWork> send_async(const at::Tensor& t, int dst, int tag) override {
    return p2p(t, dst, tag, /*send=*/true);
  }
  std::unique_ptr<CommWork> recv_async(at::Tensor& t, int src, int tag) override {
    return p2p(t, src, tag, /*send=*/false);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // A blocking collective: every rank must have started everything queued before it (a
    // barrier behind them in the queue starts only then).
    if (!queue_->empty()) barrier();
    MPI_Comm sub;
    check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::make_unique<MpiCommunicator>(sub, timeout_);
  }

 private:
  static bool native(const at::Tensor& t) { return mpi_type(t.scalar_type()) != MPI_DATATYPE_NULL; }
  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }
  static std::deque<std::function<MPI_Request()>> one(std::function<MPI_Request()> start) {
    std::deque<std::function<MPI_Request()>> steps;
    steps.push_back(std::move(start));
    return steps;
  }
  std::unique_ptr<CommWork> work(std::deque<std::function<MPI_Request()>> steps, const std::string& op,
                                 std::function<void()> then) {
    auto pending = queue_->submit(std::move(steps));
    return std::make_unique<MpiWork>(queue_, std::move(pending), cat("mpi ", op, " on rank ", rank_, " of ", size_),
                                     timeout_, std::move(then));
  }

  std::unique_ptr<CommWork> p2p(const at::Tensor& t, int peer, int tag, bool send) {
    check_p2p(t, peer, tag, send ? "send" : "recv");
    check_tag(tag);
    const int bytes = byte_count(t, send ? "send" : "recv");
    auto pending = queue_->start_now([&] {
      MPI_Request req;
      if (send) {
        check(MPI_Isend(t.data_ptr(), bytes, MPI_BYTE, peer, tag, comm_, &req), "MPI_Isend");
      } else {
        check(MPI_Irecv(t.data_ptr(), bytes, MPI_BYTE, peer, tag, comm_, &req), "MPI_Irecv");
      }
      return req;
    });
    // `then` holds the tensor: MpiWork keeps it alive while the request may still use it.
    return std::make_unique<MpiWork>(queue_, std::move(pending),
                                     cat("mpi ", send ? "send to" : "recv from", " rank ", peer, " (tag ", tag,
                                         ") on rank ", rank_, " of ", size_),
                                     timeout_, [t] {});
  }
  static int byte_count(const at::Tensor& t, const char* op) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    PT_INPUT_CHECK(bytes <= INT_MAX, "mpi: ", op, " of ", bytes, " bytes exceeds MPI's int count");
    return static_cast<int>(bytes);
  }
  // MPI only promises tags up to 32767 (MPI_TAG_UB; Open MPI's is 2^31 - 1).
  void check_tag(int tag) const {
    void* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &found);
    const int limit = found && ub ? *static_cast<int*>(ub) : 32767;
    PT_INPUT_CHECK(tag <= limit, "mpi: tag ", tag, " exceeds this MPI's MPI_TAG_UB (", limit, ")");
  }

  std::shared_ptr<OrderedQueue> queue_ = std::make_shared<OrderedQueue>();
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
};

}  // namespace


std::unique_ptr<Communicator> make_mpi_communicator(std::chrono::milliseconds timeout) {
  ensure_initialized();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, timeout);
}

}  // namespace polytrain
