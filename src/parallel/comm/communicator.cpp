#include "polytrain/parallel/comm/communicator.h"

#include <cstdlib>

#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/parallel/comm/comm_config.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#if POLYTRAIN_WITH_MPI
#include "polytrain/parallel/comm/mpi_communicator.h"
#endif
#if POLYTRAIN_WITH_NCCL
#include "polytrain/parallel/comm/nccl_communicator.h"
#endif

namespace polytrain {

bool comm_engine_available(const std::string& engine) {
  if (engine == "gloo") return POLYTRAIN_WITH_GLOO;
  if (engine == "mpi") return POLYTRAIN_WITH_MPI;
  if (engine == "nccl") return POLYTRAIN_WITH_NCCL;
  return false;
}

std::unique_ptr<CommWork> Communicator::send_async(const at::Tensor&, int, int) {
  throw Error(engine() + ": no point-to-point (send) in this communicator");
}

std::unique_ptr<CommWork> Communicator::recv_async(at::Tensor&, int, int) {
  throw Error(engine() + ": no point-to-point (recv) in this communicator");
}

void Communicator::check_p2p(const at::Tensor& t, int peer, int tag, const char* op) const {
  PT_CHECK(peer >= 0 && peer < size() && peer != rank(), engine(), " ", op, " on rank ", rank(), " of ", size(),
           ": peer rank ", peer, " is not another rank of this communicator");
  PT_CHECK(tag >= 0 && tag < kMaxTag, engine(), " ", op, ": tag ", tag, " is outside [0, 2^24)");
  PT_CHECK(t.is_contiguous(), engine(), " ", op, " needs a contiguous tensor");
}

std::unique_ptr<Communicator> make_communicator(const CommOptions& opts) {
  std::string engine = opts.engine;
  const DistEnv env = read_dist_env();
  // An MPI world exists when mpirun (or srun) started the job, or when polytrain's launcher made
  // its ranks on one host an MPI job through its PMIx server (POLYTRAIN_MPI_WORLD): on CPUs that
  // is the faster engine (shared memory against Gloo's loopback TCP; docs/parallelism.md, "Collectives
  // on one host").
  const char* served = std::getenv("POLYTRAIN_MPI_WORLD");
  const bool mpi_world = env.source == "openmpi" || env.source == "pmi" || (served && *served);
  if (engine == "auto") engine = opts.cuda ? "nccl" : (mpi_world && POLYTRAIN_WITH_MPI) ? "mpi" : "gloo";
  PT_INPUT_CHECK(engine == "gloo" || engine == "mpi" || engine == "nccl", "communicator engine '", engine,
                 "' is unknown (expected gloo, mpi, nccl or auto)");
  PT_INPUT_CHECK(comm_engine_available(engine), "communicator engine '", engine,
                 "' is not in this build (CMake found: gloo=", POLYTRAIN_WITH_GLOO, " mpi=", POLYTRAIN_WITH_MPI,
                 " nccl=", POLYTRAIN_WITH_NCCL, ")");
  fault_point("rendezvous");
#if POLYTRAIN_WITH_MPI
  if (engine == "mpi") {
    auto comm = make_mpi_communicator(opts.timeout);
    PT_INPUT_CHECK(env.world_size <= 1 || (comm->size() == env.world_size && comm->rank() == env.rank), "rank ",
                   env.rank, ": the MPI world (rank ", comm->rank(), " of ", comm->size(), ") is not the job's (rank ",
                   env.rank, " of ", env.world_size,
                   "): comm_backend mpi needs the ranks started by mpirun, srun or polytrain's launch on one host");
    return comm;
  }
#endif
#if POLYTRAIN_WITH_NCCL
  if (engine == "nccl") return make_nccl_communicator(env.rank, env.world_size, env.master_addr, env.master_port, opts.timeout);
#endif
#if POLYTRAIN_WITH_GLOO
  if (engine == "gloo") return make_gloo_communicator(env.rank, env.world_size, env.master_addr, env.master_port, opts.timeout);
#endif
  throw InternalError("unreachable: engine " + engine);
}

#if !POLYTRAIN_WITH_GLOO
// A LibTorch without Gloo's headers (Python wheels ship none): the entry point stays so that
// programs link; it says why it cannot work.
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int, const std::string&, int, std::chrono::milliseconds) {
  throw InputError(detail::cat("rank ", rank, ": the gloo communicator is not in this build (CMake found no gloo/ "
                               "headers for this LibTorch; set POLYTRAIN_THIRD_PARTY to a folder holding them)"));
}
#endif

}  // namespace polytrain
