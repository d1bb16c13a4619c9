// The CPU collective suite over MPI: ctest runs this under `mpirun -n N` for N = 1..4, and under
// polytrain's `launch --num_procs N` (no mpirun: the launcher serves PMIx) for N = 2, 3.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "polytrain/common/dist_env.h"
#include "polytrain/parallel/comm/communicator.h"

#include "helpers/collective_suite.h"
#include "polytrain/parallel/comm/mpi_communicator.h"

TEST(MpiSuite, AllCollectives) {
  at::set_num_threads(1);
  auto comm = polytrain::make_mpi_communicator(std::chrono::seconds(120));
  EXPECT_EQ(comm->engine(), "mpi");
  polytrain::comm_testing::run_collective_suite(*comm);
}

// Under launch on one host: the ranks are one MPI job with the launcher's ranks, and
// comm_backend auto picks MPI for them.
TEST(MpiSuite, AutoPicksTheMpiWorldOfLaunchOnOneHost) {
  at::set_num_threads(1);
  const char* served = std::getenv("POLYTRAIN_MPI_WORLD");
  ASSERT_TRUE(served && std::string(served) == "pmix") << "run me under `launch --num_procs N` on one host";
  const auto env = polytrain::read_dist_env();
  polytrain::CommOptions o;
  o.engine = "auto";
  o.timeout = std::chrono::seconds(120);
  auto comm = polytrain::make_communicator(o);
  EXPECT_EQ(comm->engine(), "mpi");
  EXPECT_EQ(comm->size(), env.world_size);
  EXPECT_EQ(comm->rank(), env.rank);
  polytrain::comm_testing::run_collective_suite(*comm);
}
