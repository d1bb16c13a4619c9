#include "polytrain/parallel/comm/communicator.h"

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

std::unique_ptr<Communicator> make_communicator(const CommOptions& opts) {
  std::string engine = opts.engine;
  const DistEnv env = read_dist_env();
  if (engine == "auto") {
    const bool under_mpirun = env.source == "openmpi" || env.source == "pmi";
    engine = opts.cuda ? "nccl" : (under_mpirun && POLYTRAIN_WITH_MPI) ? "mpi" : "gloo";
  }
  PT_INPUT_CHECK(engine == "gloo" || engine == "mpi" || engine == "nccl", "communicator engine '", engine,
                 "' is unknown (expected gloo, mpi, nccl or auto)");
  PT_INPUT_CHECK(comm_engine_available(engine), "communicator engine '", engine,
                 "' is not in this build (CMake found: gloo=", POLYTRAIN_WITH_GLOO, " mpi=", POLYTRAIN_WITH_MPI,
                 " nccl=", POLYTRAIN_WITH_NCCL, ")");
  fault_point("rendezvous");
#if POLYTRAIN_WITH_MPI
  if (engine == "mpi") return make_mpi_communicator(opts.timeout);
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
