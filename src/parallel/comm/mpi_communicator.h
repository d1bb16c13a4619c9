// Open MPI (any MPI-3) for CPU tensors when the job runs under mpirun: native
// MPI_Iallreduce / MPI_Ireduce_scatter_block / MPI_Iallgather / MPI_Ibcast, MPI_Comm_split.
#pragma once

#include <memory>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

/// MPI_COMM_WORLD (MPI is initialised on first use and finalised at exit).
std::unique_ptr<Communicator> make_mpi_communicator(std::chrono::milliseconds timeout);



}  // namespace polytrain
