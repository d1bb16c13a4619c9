// DdpBackend in-process with a counting single-rank communicator: gradients are bucket views,
// only the accumulation-boundary micro-step all-reduces (once per bucket), buckets follow
// reduce_bucket_size, and a parameter without a gradient is an error naming it unless
// trainer.find_unused_parameters is set.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/parallel/ddp/ddp_backend.h"

using namespace polytrain;

namespace {

class Done : public CommWork {
 public:
  void wait() override {}
};

// World of one that counts what is asked of it.
class CountingComm : public Communicator {
 public:
  int* all_reduces;
  explicit CountingComm(int* counter) : all_reduces(counter) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string engine() const override { return "counting"; }
  std::unique_ptr<CommWork> all_reduce_async(at::Tensor&, ReduceOp) override {
    ++*all_reduces;
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommWork> reduce_scatter_async(at::Tensor& out, const at::Tensor& in, ReduceOp) override {
    out.copy_(in.view_as(out));
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommWork> all_gather_async(at::Tensor& out, const at::Tensor& in) override {
    out.copy_(in.view_as(out));
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommWork> broadcast_async(at::Tensor&, int) override { return std::make_unique<Done>(); }
  std::unique_ptr<CommWork> reduce_async(at::Tensor&, int, ReduceOp) override { return std::make_unique<Done>(); }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<CountingComm>(all_reduces); }
};

struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(64, 64));    // 16.6 KB of fp32
    b = register_module("b", torch::nn::Linear(64, 1));
    unused = register_module("unused", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))).sum(); }
};

Config config(int64_t ga, int64_t bucket_bytes, bool find_unused) {
  Config c;
  c.batch.gradient_accumulation_steps = ga;
  c.optimizer.type = "SGD";
  c.optimizer.lr = 0.1;
  c.trainer.reduce_bucket_size = bucket_bytes;
  c.trainer.find_unused_parameters = find_unused;
  return c;
}

TEST(DdpBackend, OnlyTheBoundaryMicroStepCommunicates) {
  int count = 0;
  auto cfg = config(4, 500, true);
  DdpBackend ddp(cfg, std::make_unique<CountingComm>(&count));
  auto net = std::make_shared<Net>();
  ddp.prepare(net, cfg);
  // reverse order: unused (80 B) + b (260 B) + a.bias (256 B) = 596 B >= 500 | a.weight (16 KB)
  EXPECT_EQ(ddp.bucket_count(), 2u);
  EXPECT_TRUE(net->a->weight.grad().defined());
  auto x = torch::randn({3, 64});
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < 4; ++m) {
      ddp.backward(net->forward(x) / 4.0, MicroStep{3, m == 3});
      // At the boundary of step 2, a.weight's bucket goes out during backward; the other waits
      // for step() because `unused` never gets a gradient (find_unused_parameters). Step 1's
      // boundary backward only counts each parameter's accumulations (a shared parameter under
      // activation checkpointing has several), so both go out in step().
      EXPECT_EQ(count, step * 2 + (m == 3 && step > 0 ? 1 : 0)) << "step " << step << " micro " << m;
    }
    ddp.step(StepRequest{0.1, std::nullopt, 1.0}, 0);
    EXPECT_EQ(count, (step + 1) * 2);
    EXPECT_EQ(net->a->weight.grad().abs().sum().item<double>(), 0.0);  // cleared, still a view
  }
}

TEST(DdpBackend, GradientsAccumulateLikeOneProcess) {
  torch::manual_seed(0);
  auto ref = std::make_shared<Net>();
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  int count = 0;
  auto cfg = config(2, 1 << 20, true);
  DdpBackend ddp(cfg, std::make_unique<CountingComm>(&count));
  ddp.prepare(net, cfg);
  auto x1 = torch::randn({3, 64}), x2 = torch::randn({5, 64});
  ddp.backward(net->forward(x1) / 2.0, MicroStep{3, false});
  ddp.backward(net->forward(x2) / 2.0, MicroStep{5, true});
  (ref->forward(x1) / 2.0).backward();
  (ref->forward(x2) / 2.0).backward();
  EXPECT_TRUE(torch::allclose(net->a->weight.grad(), ref->a->weight.grad()));
  EXPECT_TRUE(torch::allclose(net->b->bias.grad(), ref->b->bias.grad()));
}

TEST(DdpBackend, UnusedParameterIsAnErrorUnlessAllowed) {
  int count = 0;
  auto cfg = config(1, 1 << 20, false);
  DdpBackend ddp(cfg, std::make_unique<CountingComm>(&count));
  auto net = std::make_shared<Net>();
  ddp.prepare(net, cfg);
  ddp.backward(net->forward(torch::randn({2, 64})), MicroStep{2, true});
  try {
    ddp.step(StepRequest{0.1, std::nullopt, 1.0}, 0);
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'unused."), std::string::npos)
        << e.what();
  }
}

}  // namespace
