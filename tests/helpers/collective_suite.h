// The collective suite every CPU communicator must pass, run by each rank of a group
// (threads for Gloo, mpirun processes for MPI): all_reduce (sum, avg, max), reduce_scatter,
// all_gather, broadcast, reduce, barrier, async overlap and split, over sizes 0 .. 1e6 that do not
// divide by the group size, in fp32 and bf16. Values are small integers, exact in bf16, so
// every comparison is exact.
#pragma once

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "polytrain/parallel/comm/communicator.h"

namespace polytrain::comm_testing {

inline at::Tensor pattern(int64_t n, int64_t mod, at::ScalarType dt, at::Device dev = at::kCPU) {
  return torch::arange(n, torch::kLong).remainder(mod).to(dev, dt);
}

inline void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() == 0) return;
  const auto g = got.cpu().to(torch::kDouble), w = want.cpu().to(torch::kDouble);
  EXPECT_TRUE(torch::equal(g, w)) << what << ": max diff " << (g - w).abs().max().item<double>();
}

/// `dev`: where the tensors live (CPU for Gloo and MPI, the GPU for NCCL).
inline void run_collective_suite(Communicator& comm, at::Device dev = at::kCPU) {
  const int n = comm.size(), r = comm.rank();
  const double tri = n * (n + 1) / 2.0;
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t size : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{1000003}}) {
      const std::string tag = std::string(c10::toString(dt)) + " x" + std::to_string(size) + " rank " +
                              std::to_string(r) + "/" + std::to_string(n);
      auto base = pattern(size, 7, dt, dev);
      auto t = base * (r + 1);
      comm.all_reduce(t, ReduceOp::kSum);
      expect_equal(t, base * tri, "all_reduce sum " + tag);
      t = base * (r + 1);
      comm.all_reduce(t, ReduceOp::kAvg);
      expect_equal(t, base.to(torch::kDouble) * (tri / n), "all_reduce avg " + tag);
      t = base * (r + 1);
      comm.all_reduce(t, ReduceOp::kMax);
      expect_equal(t, base * n, "all_reduce max " + tag);

      // reduce_scatter: `size` elements per rank (odd sizes: nothing divides evenly).
      auto in = pattern(size * n, 7, dt, dev) * (r + 1);
      auto out = torch::full({size}, -1, torch::TensorOptions(dt).device(dev));
      comm.reduce_scatter(out, in, ReduceOp::kSum);
      expect_equal(out, pattern(size * n, 7, dt).narrow(0, r * size, size) * tri, "reduce_scatter " + tag);

      auto mine = pattern(size, 3, dt, dev) + r;
      auto gathered = torch::full({size * n}, -1, torch::TensorOptions(dt).device(dev));
      comm.all_gather(gathered, mine);
      for (int k = 0; k < n; ++k) {
        expect_equal(gathered.narrow(0, k * size, size), pattern(size, 3, dt) + k, "all_gather block " + std::to_string(k) + " " + tag);
      }

      const int root = n - 1;
      auto b = r == root ? pattern(size, 5, dt, dev) : torch::zeros({size}, torch::TensorOptions(dt).device(dev));
      comm.broadcast(b, root);
      expect_equal(b, pattern(size, 5, dt), "broadcast " + tag);

      // reduce to every root in turn (the root's buffer only is defined afterwards), sum and avg.
      for (int to = 0; to < n; ++to) {
        auto red = base * (r + 1);
        comm.reduce(red, to, ReduceOp::kSum);
        if (r == to) expect_equal(red, base * tri, "reduce sum to " + std::to_string(to) + " " + tag);
        red = base * (r + 1);
        comm.reduce(red, to, ReduceOp::kAvg);
        if (r == to) expect_equal(red, base.to(torch::kDouble) * (tri / n), "reduce avg " + tag);
      }
    }
  }
  // Two collectives in flight at once, waited in reverse order.
  auto x = torch::full({4097}, r + 1.0, dev), y = torch::full({33}, 2.0 * (r + 1), dev);
  auto wx = comm.all_reduce_async(x, ReduceOp::kSum);
  auto wy = comm.all_reduce_async(y, ReduceOp::kSum);
  wy->wait();
  wx->wait();
  expect_equal(x, torch::full({4097}, tri), "async x");
  expect_equal(y, torch::full({33}, 2 * tri), "async y");
  comm.barrier();

  // split: even and odd ranks, ordered by descending rank (key = -rank).
  auto sub = comm.split(r % 2, -r);
  int members = 0, expected_sub_rank = 0;
  for (int k = r % 2; k < n; k += 2) {
    ++members;
    if (k > r) ++expected_sub_rank;
  }
  EXPECT_EQ(sub->size(), members);
  EXPECT_EQ(sub->rank(), expected_sub_rank);
  auto s = torch::full({3}, static_cast<double>(r), dev);
  sub->all_reduce(s, ReduceOp::kSum);
  double want = 0;
  for (int k = r % 2; k < n; k += 2) want += k;
  expect_equal(s, torch::full({3}, want), "split all_reduce rank " + std::to_string(r));
  comm.barrier();
}

}  // namespace polytrain::comm_testing
