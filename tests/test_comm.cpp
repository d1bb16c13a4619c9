// The CPU collective suite (tests/helpers/collective_suite.h) over Gloo with 1 to 4 ranks as
// threads on loopback; the stated Gloo fallbacks (avg, bf16, reduce_scatter, flat all_gather)
// are exercised by it. A collective that a peer never joins fails with an error naming the
// rank and the operation instead of hanging. (MPI runs the same suite: tests/mpi_collectives.cpp.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "polytrain/common/error.h"
#include "helpers/collective_suite.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "helpers/free_port.h"
#include "helpers/require.h"

using namespace polytrain;

namespace {

using polytrain::testing::free_port;

template <class F>
void on_ranks(int world, F body) {
  const int port = free_port();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([=] {
      auto comm = make_gloo_communicator(r, world, "127.0.0.1", port, std::chrono::seconds(60));
      body(*comm);
    });
  }
  for (auto& t : threads) t.join();
}

class GlooSuite : public ::testing::TestWithParam<int> {};

TEST_P(GlooSuite, AllCollectives) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  at::set_num_threads(1);
  on_ranks(GetParam(), [](Communicator& c) {
    EXPECT_EQ(c.engine(), "gloo");
    comm_testing::run_collective_suite(c);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooSuite, ::testing::Values(1, 2, 3, 4));

// NCCL: only in CUDA builds on a machine with a GPU; one rank per GPU, so world size 1 on a
// one-GPU machine (more GPUs: run tests/mpi-style under launch).
TEST(Nccl, AllCollectivesOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA (no GPU visible)";
  PT_SKIP_UNLESS(comm_engine_available("nccl"), "NCCL in this build (a CUDA LibTorch and nccl.h, see docs/building.md)");
  auto comm = make_communicator(CommOptions{"nccl", std::chrono::seconds(60), true});
  EXPECT_EQ(comm->engine(), "nccl");
  comm_testing::run_collective_suite(*comm, at::Device(at::kCUDA, 0));
}

TEST(Gloo, MissingPeerTimesOutNamingRankAndOperation) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  const int port = free_port();
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  std::string error;
  std::thread r1([&] {
    auto comm = make_gloo_communicator(1, 2, "127.0.0.1", port, std::chrono::seconds(2));
    done.wait();  // never joins the all_reduce
  });
  {
    auto comm = make_gloo_communicator(0, 2, "127.0.0.1", port, std::chrono::seconds(2));
    auto t = torch::ones({16});
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t);
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
    rank0_done.set_value();
    r1.join();
  }
  EXPECT_NE(error.find("gloo all_reduce on rank 0 of 2 failed"), std::string::npos) << error;
}

TEST(Gloo, UnreachableRendezvousIsAnError) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  std::string error;
  try {
    make_gloo_communicator(1, 2, "127.0.0.1", free_port(), std::chrono::seconds(1));
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("rank 1 of 2 could not reach the rendezvous at 127.0.0.1:"), std::string::npos) << error;
}

}  // namespace
