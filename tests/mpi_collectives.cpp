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

// All-reduces above the segment size (2 MiB: each runs as a chain of segments, the last one
// short), with other collectives started behind them before anything is waited for: every rank
// must start them in the same order whatever its timing, and every result is exact. Waited in
// reverse order, so waiting for the later ones must drive the earlier chains to completion.
TEST(MpiSuite, SegmentedAllReduceKeepsCollectiveOrderAcrossRanks) {
  at::set_num_threads(1);
  polytrain::CommOptions o;
  o.engine = "mpi";
  o.timeout = std::chrono::seconds(120);
  auto comm = polytrain::make_communicator(o);
  const int n = comm->size(), r = comm->rank();
  const double tri = n * (n + 1) / 2.0;
  using polytrain::comm_testing::expect_equal;
  using polytrain::comm_testing::pattern;
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    const int64_t big = (int64_t{5} << 20) / 4 * 3 + 17;  // 15 MiB + 68 B in fp32 (bf16 travels as fp32): 7.5 segments
    auto base = pattern(big, 7, dt), small_base = pattern(1001, 5, dt);
    auto a = base * (r + 1), b = small_base * (r + 1), c = pattern(4096, 3, dt) * (r == 1 % n ? 1 : 0) + (r == 1 % n ? 0 : 9);
    auto d = base * (r + 2);
    auto wa = comm->all_reduce_async(a, polytrain::ReduceOp::kSum);
    auto wb = comm->all_reduce_async(b, polytrain::ReduceOp::kAvg);
    auto wc = comm->broadcast_async(c, 1 % n);
    auto wd = comm->all_reduce_async(d, polytrain::ReduceOp::kSum);
    wd->wait();
    wc->wait();
    wb->wait();
    wa->wait();
    const std::string tag = std::string(c10::toString(dt)) + " rank " + std::to_string(r) + "/" + std::to_string(n);
    expect_equal(a, base * tri, "segmented all_reduce " + tag);
    expect_equal(b, small_base * (tri / n), "all_reduce avg queued behind it " + tag);
    expect_equal(c, pattern(4096, 3, dt), "broadcast queued behind it " + tag);
    expect_equal(d, base * (tri + n), "second segmented all_reduce " + tag);
    comm->barrier();
  }
}
