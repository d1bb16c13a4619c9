// The CPU collective suite (tests/helpers/collective_suite.h) over Gloo with 1 to 4 ranks as
// threads on loopback; the stated Gloo fallbacks (avg, bf16, reduce_scatter, flat all_gather)
// are exercised by it. A collective that a peer never joins fails with an error naming the
// rank and the operation instead of hanging. (MPI runs the same suite: tests/mpi_collectives.cpp.)
// Point-to-point over Gloo: every dtype bit-exact (as raw bytes), tags matched whatever the
// order, a ring that would deadlock on blocking sends, a silent or departed peer failing wait()
// with a CommFailure; each under a deadline that aborts the program rather than hang the suite.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/comm_failure.h"
#include "polytrain/parallel/comm/counting_communicator.h"
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

// ---- point-to-point ----------------------------------------------------------------------

// Runs `body(comm)` on `world` ranks as threads (Gloo, communicator timeout `timeout`); an exception
// in a rank fails the test. A rank still running after `deadline` aborts the program: a hang in
// point-to-point (the failure these tests look for) must not stall the whole suite.
template <class F>
void p2p_ranks(int world, std::chrono::milliseconds timeout, std::chrono::seconds deadline, F body) {
  const int port = free_port();
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(make_gloo_communicator(r, world, "127.0.0.1", port, timeout));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, deadline, [&] { return finished == world; })) {
      std::fprintf(stderr, "FATAL: %s: %d of %d ranks still running after %lld s (a point-to-point hang)\n",
                   ::testing::UnitTest::GetInstance()->current_test_info()->name(), world - finished, world,
                   static_cast<long long>(deadline.count()));
      std::fflush(stderr);
      std::abort();
    }
  }
  for (auto& t : threads) t.join();
}

// Compares the bytes, so NaN payloads, -0 and bf16's low bits count.
void expect_bit_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() == 0) return;
  EXPECT_TRUE(torch::equal(got.reshape({-1}).view(torch::kByte), want.reshape({-1}).view(torch::kByte))) << what;
}

// A message both ranks can build (no RNG: the ranks are threads of one process): values spread over
// the dtype's range, and for floats the specials whose bits a conversion would change (-0, the
// infinities, a subnormal, a NaN with a payload; for bf16 a signalling NaN's bits).
at::Tensor message(at::ScalarType dt, int64_t n, int salt) {
  auto i = torch::arange(n, torch::kLong) + salt;
  if (dt == torch::kBool) return i.remainder(3).eq(0);
  if (!at::isFloatingType(dt)) {
    return (i * int64_t{2654435761}).remainder(int64_t{1} << 40).sub(int64_t{1} << 39).to(dt);
  }
  auto t = (i.to(torch::kDouble) * 0.7311).sin().mul(1e3).to(dt);
  if (n >= 5) {
    t[0] = -0.0;
    t[1] = std::numeric_limits<float>::infinity();
    t[2] = -std::numeric_limits<float>::infinity();
    t[3] = 1e-40;  // fp32 and bf16 subnormal
    t[4] = std::nanf("7");
  }
  if (dt == torch::kBFloat16 && n >= 6) t.view(torch::kShort)[5] = 0x7f81;
  return t;
}

TEST(GlooP2p, PingPongIsBitExactForEveryDtypeAndCounted) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  at::set_num_threads(1);
  p2p_ranks(2, std::chrono::seconds(30), std::chrono::seconds(120), [](std::unique_ptr<Communicator> world) {
    // Through the counting wrapper: it forwards, and counts the bytes each rank sends.
    CountingCommunicator c(std::move(world));
    const int peer = 1 - c.rank();
    int64_t sent = 0;
    int tag = 0;
    for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kLong, torch::kHalf, torch::kBool}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{3} << 20}) {
        const std::string what = std::string(c10::toString(dt)) + " x" + std::to_string(n);
        const auto want = message(dt, n, static_cast<int>(n % 97));
        ++tag;
        if (c.rank() == 0) {
          c.send(want, peer, tag);
          auto back = torch::zeros({n}, torch::TensorOptions(dt));
          c.recv(back, peer, tag + 1000);
          expect_bit_equal(back, want, "rank 0 got back " + what);
        } else {
          auto got = torch::zeros({n}, torch::TensorOptions(dt));
          c.recv(got, peer, tag);
          expect_bit_equal(got, want, "rank 1 got " + what);
          c.send(got, peer, tag + 1000);
        }
        sent += n * static_cast<int64_t>(c10::elementSize(dt));
      }
    }
    // A 2-d tensor with a zero dimension, and a 0-d one (4 bytes, sent by rank 0 only).
    auto empty2d = torch::zeros({3, 0});
    auto scalar = torch::tensor(c.rank() == 0 ? 2.5f : 0.0f).reshape({});
    if (c.rank() == 0) {
      c.send(empty2d, peer, 7);
      c.send(scalar, peer, 8);
      sent += 4;
    } else {
      c.recv(empty2d, peer, 7);
      c.recv(scalar, peer, 8);
      EXPECT_EQ(scalar.item<float>(), 2.5f);
    }
    EXPECT_EQ(c.p2p_bytes.load(), sent);
    EXPECT_EQ(c.total(), sent);
    c.barrier();
  });
}

// Eight messages in flight at once between one pair, received in the reverse order of sending
// (each recv waited before the next is posted), two more on one tag, which arrive in send order.
TEST(GlooP2p, TagsMatchWhateverTheOrder) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  at::set_num_threads(1);
  p2p_ranks(2, std::chrono::seconds(30), std::chrono::seconds(120), [](std::unique_ptr<Communicator> comm) {
    constexpr int kMessages = 8;
    auto size_of = [](int k) { return int64_t{1} << (2 * k + 3); };  // 8 elements .. 512 Ki (2 MiB of fp32)
    if (comm->rank() == 0) {
      std::vector<at::Tensor> out;
      std::vector<std::unique_ptr<CommWork>> works;
      for (int k = 0; k < kMessages; ++k) {
        out.push_back(message(torch::kFloat, size_of(k), k));
        works.push_back(comm->send_async(out.back(), 1, 100 + k));
      }
      auto first = torch::full({5}, 1.0f), second = torch::full({5}, 2.0f);
      works.push_back(comm->send_async(first, 1, Communicator::kMaxTag - 1));
      works.push_back(comm->send_async(second, 1, Communicator::kMaxTag - 1));
      for (auto& w : works) w->wait();
    } else {
      for (int k = kMessages - 1; k >= 0; --k) {
        auto in = torch::zeros({size_of(k)});
        comm->recv(in, 0, 100 + k);
        expect_bit_equal(in, message(torch::kFloat, size_of(k), k), "message with tag " + std::to_string(100 + k));
      }
      auto a = torch::zeros({5}), b = torch::zeros({5});
      auto wb = comm->recv_async(a, 0, Communicator::kMaxTag - 1);
      auto wa = comm->recv_async(b, 0, Communicator::kMaxTag - 1);
      wa->wait();
      wb->wait();
      EXPECT_TRUE(torch::equal(a, torch::full({5}, 1.0f)) && torch::equal(b, torch::full({5}, 2.0f)))
          << "one tag's messages arrive in send order";
    }
    comm->barrier();
  });
}

// Every rank sends to the next and receives from the previous at once, 4 MiB a message (well
// past any eager limit: blocking sends would deadlock), several rounds.
TEST(GlooP2p, RingOfThreeDoesNotDeadlock) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  at::set_num_threads(1);
  p2p_ranks(3, std::chrono::seconds(30), std::chrono::seconds(120), [](std::unique_ptr<Communicator> comm) {
    const int n = comm->size(), r = comm->rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
    constexpr int64_t kElems = int64_t{1} << 20;
    for (int round = 0; round < 4; ++round) {
      auto out = message(torch::kFloat, kElems, 10 * round + r);
      auto in = torch::zeros({kElems});
      auto ws = comm->send_async(out, next, round);
      auto wr = comm->recv_async(in, prev, round);
      wr->wait();
      ws->wait();
      expect_bit_equal(in, message(torch::kFloat, kElems, 10 * round + prev),
                       "round " + std::to_string(round) + " on rank " + std::to_string(r));
    }
    comm->barrier();
  });
}

TEST(GlooP2p, BadArgumentsAreErrors) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  p2p_ranks(2, std::chrono::seconds(30), std::chrono::seconds(60), [](std::unique_ptr<Communicator> comm) {
    auto t = torch::zeros({4});
    const int r = comm->rank();
    EXPECT_THROW(comm->send_async(t, r, 0), Error) << "to itself";
    EXPECT_THROW(comm->send_async(t, 2, 0), Error) << "outside the group";
    EXPECT_THROW(comm->recv_async(t, -1, 0), Error) << "outside the group";
    EXPECT_THROW(comm->send_async(t, 1 - r, Communicator::kMaxTag), Error) << "tag too large";
    EXPECT_THROW(comm->recv_async(t, 1 - r, -1), Error) << "negative tag";
    auto strided = torch::zeros({4, 4}).t();
    EXPECT_THROW(comm->send_async(strided, 1 - r, 0), Error) << "not contiguous";
    comm->barrier();
  });
}

// A recv of 16 floats from `src` that should fail: the CommFailure's message (another error's, or
// none, is reported so), and in `took` the seconds until it came.
std::string failed_recv(Communicator& comm, int src, int tag, double* took) {
  auto t = torch::zeros({16});
  const auto t0 = std::chrono::steady_clock::now();
  std::string error = "no error";
  try {
    comm.recv(t, src, tag);
  } catch (const CommFailure& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = std::string("not a CommFailure: ") + e.what();
  }
  *took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return error;
}

// Rank 0 never sends: rank 1's recv fails with a CommFailure naming it after the communicator's
// timeout (2 s), not never.
TEST(GlooP2p, RecvFromASilentPeerTimesOut) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  std::promise<void> rank1_done;
  auto done = rank1_done.get_future().share();
  std::string error;
  double took = 0;
  p2p_ranks(2, std::chrono::seconds(2), std::chrono::seconds(60), [&](std::unique_ptr<Communicator> comm) {
    if (comm->rank() == 0) {
      done.wait();  // alive, connected, silent
      return;
    }
    error = failed_recv(*comm, 0, 5, &took);
    rank1_done.set_value();
  });
  EXPECT_NE(error.find("gloo recv from rank 0 (tag 5) on rank 1 of 2 failed"), std::string::npos) << error;
  EXPECT_GE(took, 1.5);
  EXPECT_LT(took, 20.0);
}

// Rank 1 connects, then leaves (its communicator closes its connections) while rank 0 waits to
// receive from it: the recv fails with a CommFailure well before the 30 s timeout.
TEST(GlooP2p, RecvFromAPeerThatLeftFails) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  std::string error;
  double took = 0;
  p2p_ranks(2, std::chrono::seconds(30), std::chrono::seconds(90), [&](std::unique_ptr<Communicator> comm) {
    comm->barrier();  // both connected
    if (comm->rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0's recv is posted
      comm.reset();
      return;
    }
    error = failed_recv(*comm, 1, 3, &took);
  });
  EXPECT_NE(error.find("gloo recv from rank 1 (tag 3) on rank 0 of 2 failed"), std::string::npos) << error;
  EXPECT_LT(took, 15.0);
}

}  // namespace
