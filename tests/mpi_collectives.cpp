// The CPU collective suite over MPI: ctest runs this under `mpirun -n N` for N = 1..4, and under
// polytrain's `launch --num_procs N` (no mpirun: the launcher serves PMIx) for N = 2, 3.
// Point-to-point over MPI runs in both too: a ping-pong between rank pairs and a ring.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
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

namespace {

std::unique_ptr<polytrain::Communicator> mpi_world() {
  polytrain::CommOptions o;
  o.engine = "mpi";
  o.timeout = std::chrono::seconds(120);
  return polytrain::make_communicator(o);
}

// Every byte, so bf16's low bits and NaN payloads count.
bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) return false;
  return a.numel() == 0 || torch::equal(a.reshape({-1}).view(torch::kByte), b.reshape({-1}).view(torch::kByte));
}

at::Tensor message(at::ScalarType dt, int64_t n, int salt) {
  auto i = torch::arange(n, torch::kLong) + salt;
  if (!at::isFloatingType(dt)) return (i * int64_t{2654435761}).remainder(int64_t{1} << 40).to(dt);
  auto t = (i.to(torch::kDouble) * 0.7311).sin().mul(1e3).to(dt);
  if (n >= 2) {
    t[0] = -0.0;
    t[1] = std::nanf("7");
  }
  return t;
}

}  // namespace

// Ranks 2k and 2k+1 play ping-pong (an odd last rank sits out), fp32, bf16 and int64 bit-exact,
// 0 to 24 MiB, then two messages in flight received in the reverse order of their tags.
TEST(MpiSuite, PointToPointPingPong) {
  at::set_num_threads(1);
  auto comm = mpi_world();
  const int r = comm->rank(), peer = r ^ 1;
  if (peer < comm->size()) {
    int tag = 0;
    for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kLong}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{3} << 20}) {
        const std::string what = std::string(c10::toString(dt)) + " x" + std::to_string(n) + " rank " +
                                 std::to_string(r);
        const auto want = message(dt, n, static_cast<int>(n % 97));
        ++tag;
        if (r % 2 == 0) {
          comm->send(want, peer, tag);
          auto back = torch::zeros({n}, torch::TensorOptions(dt));
          comm->recv(back, peer, tag + 1000);
          EXPECT_TRUE(bit_equal(back, want)) << "came back: " << what;
        } else {
          auto got = torch::zeros({n}, torch::TensorOptions(dt));
          comm->recv(got, peer, tag);
          EXPECT_TRUE(bit_equal(got, want)) << "received: " << what;
          comm->send(got, peer, tag + 1000);
        }
      }
    }
    auto a = message(torch::kFloat, 1 << 20, 1), b = message(torch::kFloat, 1 << 20, 2);
    if (r % 2 == 0) {
      auto wa = comm->send_async(a, peer, 11);
      auto wb = comm->send_async(b, peer, 12);
      wa->wait();
      wb->wait();
    } else {
      auto ga = torch::zeros_like(a), gb = torch::zeros_like(b);
      auto wb = comm->recv_async(gb, peer, 12);
      wb->wait();
      auto wa = comm->recv_async(ga, peer, 11);
      wa->wait();
      EXPECT_TRUE(bit_equal(ga, a) && bit_equal(gb, b)) << "received in the reverse order of the tags";
    }
  }
  comm->barrier();
}

// Every rank sends 4 MiB to the next and receives from the previous at once (blocking sends would
// deadlock), with an all-reduce started before the transfers and waited after them.
TEST(MpiSuite, PointToPointRing) {
  at::set_num_threads(1);
  auto comm = mpi_world();
  const int n = comm->size(), r = comm->rank();
  if (n < 2) GTEST_SKIP() << "a ring needs 2 ranks";
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int round = 0; round < 3; ++round) {
    auto sum = torch::full({4097}, static_cast<float>(r + 1));
    auto wsum = comm->all_reduce_async(sum, polytrain::ReduceOp::kSum);
    auto out = message(torch::kBFloat16, int64_t{2} << 20, 10 * round + r);
    auto in = torch::zeros_like(out);
    auto ws = comm->send_async(out, next, round);
    auto wr = comm->recv_async(in, prev, round);
    wr->wait();
    ws->wait();
    wsum->wait();
    EXPECT_TRUE(bit_equal(in, message(torch::kBFloat16, int64_t{2} << 20, 10 * round + prev)))
        << "round " << round << " on rank " << r;
    EXPECT_TRUE(torch::equal(sum, torch::full({4097}, n * (n + 1) / 2.0f))) << "the all_reduce beside it";
  }
  comm->barrier();
}
