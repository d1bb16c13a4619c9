// The Communicator: the collectives every multi-process backend stands on (all_reduce,
// reduce_scatter, all_gather, broadcast, reduce, barrier, sub-groups) and point-to-point
// send/recv (pipeline stages), sync or async, over an existing engine: Gloo (libtorch c10d,
// CPU), Open MPI (CPU, under mpirun), NCCL (CUDA).
// This header is engine-free; make_communicator() picks one. No collective algorithm lives
// here: where an engine lacks an operation, each implementation states its fallback.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

namespace polytrain {

enum class ReduceOp { kSum, kAvg, kMax };

/// Handle of an asynchronous collective. wait() returns when the result is in place, or
/// throws an Error naming the operation and rank (a timeout included).
class CommWork {
 public:
  virtual ~CommWork() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "gloo", "mpi" or "nccl".
  virtual std::string engine() const = 0;

  /// In place over every rank's `t` (contiguous).
  virtual std::unique_ptr<CommWork> all_reduce_async(at::Tensor& t, ReduceOp op) = 0;
  /// `in` holds size() * out.numel() elements; rank r receives the reduction of block r.
  virtual std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp op) = 0;
  /// `out` holds size() * in.numel() elements: block r is rank r's `in`.
  virtual std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) = 0;
  /// `t` takes root's value on every rank.
  virtual std::unique_ptr<CommWork> broadcast_async(at::Tensor& t, int root) = 0;
  /// Root's `t` becomes the reduction of every rank's `t` (in place, contiguous); the other
  /// ranks' `t` may be used as scratch and is undefined afterwards.
  virtual std::unique_ptr<CommWork> reduce_async(at::Tensor& t, int root, ReduceOp op) = 0;
  virtual void barrier() = 0;

  /// The ranks with the same `color` form a new communicator, ordered by (key, rank), as
  /// MPI_Comm_split. Every rank must call it (collective).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  /// Point-to-point. Sends `t` (contiguous) to rank `dst` of this communicator, matched on the
  /// receiver by `tag` (0 <= tag < kMaxTag, and <= MPI_TAG_UB under MPI). Gloo and MPI match by
  /// (source, tag), one tag's messages in send order; NCCL has no tags and matches a pair's
  /// messages in call order. Any dtype travels bit-exact, as raw bytes. `t` must stay alive and
  /// unchanged until wait() returns. A peer that is gone, or a transfer silent past the timeout,
  /// fails wait() as the collectives do (a CommFailure under Gloo and NCCL).
  /// The defaults throw: a wrapper over an engine without point-to-point says so.
  virtual std::unique_ptr<CommWork> send_async(const at::Tensor& t, int dst, int tag);
  /// Receives into `t` (contiguous, the sender's dtype and element count) from rank `src`'s
  /// message with `tag`.
  virtual std::unique_ptr<CommWork> recv_async(at::Tensor& t, int src, int tag);
  static constexpr int kMaxTag = 1 << 24;

  void all_reduce(at::Tensor& t, ReduceOp op = ReduceOp::kSum) { all_reduce_async(t, op)->wait(); }
  void reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op = ReduceOp::kSum) {
    reduce_scatter_async(out, in, op)->wait();
  }
  void all_gather(at::Tensor& out, const at::Tensor& in) { all_gather_async(out, in)->wait(); }
  void broadcast(at::Tensor& t, int root = 0) { broadcast_async(t, root)->wait(); }
  void reduce(at::Tensor& t, int root, ReduceOp op = ReduceOp::kSum) { reduce_async(t, root, op)->wait(); }
  void send(const at::Tensor& t, int dst, int tag = 0) { send_async(t, dst, tag)->wait(); }
  void recv(at::Tensor& t, int src, int tag = 0) { recv_async(t, src, tag)->wait(); }

 protected:
  /// The checks every engine's send_async/recv_async makes first: `peer` is another rank of
  /// this communicator, `tag` in range, `t` contiguous. `op` is "send" or "recv".
  void check_p2p(const at::Tensor& t, int peer, int tag, const char* op) const;
};

struct CommOptions {
  /// gloo, mpi, nccl; "auto": nccl for a CUDA device, mpi when there is an MPI world (started by
  /// mpirun or srun, or by polytrain's launch on one host, which serves PMIx) and the build has
  /// MPI, else gloo.
  std::string engine = "auto";
  /// A collective (or the rendezvous) that takes longer fails with an error naming the rank
  /// and the operation instead of hanging.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  bool cuda = false;  ///< the tensors will live on the current CUDA device
};

/// The world communicator of this process, from the launcher's environment (RANK,
/// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or OMPI_COMM_WORLD_* under mpirun).
std::unique_ptr<Communicator> make_communicator(const CommOptions& opts);

/// Whether this build has the engine ("gloo" always; "mpi", "nccl" per CMake).
bool comm_engine_available(const std::string& engine);

}  // namespace polytrain
