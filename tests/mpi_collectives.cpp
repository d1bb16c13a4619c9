// The CPU collective suite over MPI: ctest runs this under `mpirun -n N` for N = 1..4.
#include <gtest/gtest.h>

#include "helpers/collective_suite.h"
#include "polytrain/parallel/comm/mpi_communicator.h"

TEST(MpiSuite, AllCollectives) {
  at::set_num_threads(1);
  auto comm = polytrain::make_mpi_communicator(std::chrono::seconds(120));
  EXPECT_EQ(comm->engine(), "mpi");
  polytrain::comm_testing::run_collective_suite(*comm);
}
