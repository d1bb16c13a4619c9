// MPI has every collective natively, non-blocking since MPI-3. Its gaps:
//   - no half/bf16 datatype: those tensors are reduced as an fp32 copy, rounded back once;
//   - no avg: sum, then divide by the group size;
//   - no timeout: wait() polls MPI_Test (which also drives progress) against a deadline and
//     fails naming the operation and rank; mpirun then stops the other ranks.
#include "polytrain/parallel/comm/mpi_communicator.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <functional>
#include <thread>

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

class MpiWork : public CommWork {
 public:
  MpiWork(MPI_Request req, std::string what, std::chrono::milliseconds timeout, std::function<void()> then)
      : req_(req), what_(std::move(what)), timeout_(timeout), then_(std::move(then)) {}
  ~MpiWork() override {
    // Its buffers must outlive the operation. Normally it has ended or ends within the deadline;
    // when a peer was lost (this one timed out, or another did: the error is on its way up),
    // MPI may still write into them, so they are left allocated and the request pending: the
    // process is about to exit, and waiting here would keep it from doing so.
    bool finished = req_ == MPI_REQUEST_NULL;
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
  // Polls the request until it completes (true) or the deadline passes (false; peer lost).
  bool finish_by(std::chrono::steady_clock::time_point deadline) {
    int done = 0;
    while (req_ != MPI_REQUEST_NULL) {
      check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), what_.c_str());
      if (done) break;
      if (g_peer_lost || std::chrono::steady_clock::now() > deadline) {
        g_peer_lost = true;
        return false;
      }
      std::this_thread::yield();
    }
    return true;
  }

  MPI_Request req_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::function<void()> then_;
};

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
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count_of(buf), mpi_type(buf.scalar_type()), mpi_op(op), comm_, &req),
          "MPI_Iallreduce");
    const int n = size_;
    return work(req, "all_reduce", [t, buf, op, n]() mutable {
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
    MPI_Request req;
    check(MPI_Ireduce_scatter_block(src.data_ptr(), dst.data_ptr(), count_of(out), mpi_type(src.scalar_type()),
                                    mpi_op(op), comm_, &req),
          "MPI_Ireduce_scatter_block");
    const int n = size_;
    return work(req, "reduce_scatter", [out, dst, src, op, n]() mutable {
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
    MPI_Request req;
    check(MPI_Iallgather(src.data_ptr(), static_cast<int>(bytes), MPI_BYTE, out.data_ptr(), static_cast<int>(bytes),
                         MPI_BYTE, comm_, &req),
          "MPI_Iallgather");
    return work(req, "all_gather", [src]() {});
  }

  std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) override {
    PT_CHECK(t.is_contiguous(), "broadcast needs a contiguous tensor");
    const int64_t bytes = t.numel() * t.element_size();
    PT_INPUT_CHECK(bytes <= INT_MAX, "mpi: broadcast of ", bytes, " bytes exceeds MPI's int count");
    MPI_Request req;
    check(MPI_Ibcast(t.data_ptr(), static_cast<int>(bytes), MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    return work(req, cat("broadcast from rank ", root), [t]() {});
  }

  std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) override {
    PT_CHECK(t.is_contiguous(), "reduce needs a contiguous tensor");
    at::Tensor buf = native(t) ? t : t.to(at::kFloat);
    const bool at_root = rank_ == root;
    MPI_Request req;
    check(MPI_Ireduce(at_root ? MPI_IN_PLACE : buf.data_ptr(), buf.data_ptr(), count_of(buf), mpi_type(buf.scalar_type()),
                      mpi_op(op), root, comm_, &req),
          "MPI_Ireduce");
    const int n = size_;
    return work(req, cat("reduce to rank ", root), [t, buf, op, n, at_root]() mutable {
      if (!at_root) return;
      if (op == ReduceOp::kAvg) buf.div_(n);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  void barrier() override {
    MPI_Request req;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    work(req, "barrier", {})->wait();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub;
    check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::make_unique<MpiCommunicator>(sub, timeout_);
  }

 private:
  static bool native(const at::Tensor& t) { return mpi_type(t.scalar_type()) != MPI_DATATYPE_NULL; }
  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }
  std::unique_ptr<CommWork> work(MPI_Request req, const std::string& op, std::function<void()> then) {
    return std::make_unique<MpiWork>(req, cat("mpi ", op, " on rank ", rank_, " of ", size_), timeout_,
                                     std::move(then));
  }

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
