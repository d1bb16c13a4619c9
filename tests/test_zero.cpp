// env_type deepspeed (ZeRO stages 0-2, CPU offload) against its contract, ranks as real
// processes over Gloo on loopback (forked, each run with a deadline, ended by pid), through the
// real Trainer loop:
//   - stage 0, 1, 2 and 2 + offload at 1, 2, 3 and 4 ranks reproduce the single-process
//     (env_type pytorch, torch's AdamW) loss trajectory within 1e-5 relative over 50 steps,
//     with gradient accumulation 2, clipping, a frozen parameter, parameters straddling
//     partition boundaries and partitions holding only padding;
//   - stage 1 and stage 2 give bit-identical losses at one micro-step per step;
//   - saved at 2 ranks, resumed at 1 and 3: the re-sliced optimizer state is bit-identical to
//     the saved one and the next 5 losses match the uninterrupted run; zero_to_fp32's export
//     equals the consolidated model bit for bit;
//   - memory by the backend's accounting against ZeRO's formulas, bytes per step counted by a
//     wrapper (2 x the parameters, as DDP), one overflow skips on every rank, config errors;
//   - bf16 parameters keep fp32 masters with the fused copy-out; a layer shared by two
//     checkpointed blocks (gradient accumulated twice per backward) is reduced whole by ZeRO
//     stage 2 and by pytorchDDP with overlap.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/parallel/comm/counting_communicator.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/zero/zero_backend.h"
#include "polytrain/parallel/zero/zero_export.h"
#include "polytrain/parallel/zero/zero_layout.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/process.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
namespace fs = std::filesystem;
using json = nlohmann::json;
using polytrain::testing::free_port;
using polytrain::testing::run_ranks;

namespace {

// Sample i: 4 features of i, a nonlinear target.
class WaveSource : public BatchSource {
 public:
  explicit WaveSource(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t /*epoch*/) const override {
    auto f = torch::tensor(indices, torch::kLong).to(torch::kDouble).unsqueeze(1);
    auto x = torch::cat({torch::sin(f * 0.7), torch::cos(f * 1.3), torch::sin(f * 0.11 + 1), f.remainder(5) / 5}, 1)
                 .to(torch::kFloat);
    Batch b;
    b.set("x", x);
    b.set("y", torch::tanh((x * torch::tensor({1.5f, -2.0f, 0.5f, 3.0f})).sum(1, true)) + 0.25);
    return b;
  }

 private:
  int64_t n_;
};

// 171 trainable elements: weights 150 (decayed), biases 21 (not); a frozen input scale. At 3
// ranks lin2.weight straddles two partition boundaries and the bias group's third partition
// is padding only; at 4 ranks two bias partitions are.
struct Mlp : torch::nn::Module {
  torch::nn::Linear lin1{nullptr}, lin2{nullptr}, lin3{nullptr};
  at::Tensor scale;
  Mlp() {
    torch::manual_seed(7);
    lin1 = register_module("lin1", torch::nn::Linear(4, 13));
    lin2 = register_module("lin2", torch::nn::Linear(13, 7));
    lin3 = register_module("lin3", torch::nn::Linear(7, 1));
    scale = register_parameter("scale", torch::tensor({1.0f, 0.5f, 2.0f, 1.5f}), /*requires_grad=*/false);
  }
  at::Tensor forward(const at::Tensor& x) {
    return lin3(torch::tanh(lin2(torch::tanh(lin1(x * scale)))));
  }
};

class MlpTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    ModelOutput out;
    out.loss = (dynamic_cast<Mlp&>(model).forward(batch.at("x")) - batch.at("y")).pow(2).mean();
    return out;
  }
};

struct Variant {
  int stage = 2;
  bool offload = false;
  int64_t accumulation = 2;
};

json zero_block(const Variant& v) {
  json z = {{"stage", v.stage}, {"reduce_bucket_size", 40}, {"allgather_bucket_size", 32}, {"overlap_comm", true}};
  if (v.offload) z["offload_optimizer"] = {{"device", "cpu"}};
  return z;
}

Config run_config(const fs::path& dir, int world, const std::string& env, const Variant& v, int64_t steps) {
  json doc = {{"train_batch_size", 24},
              {"gradient_accumulation_steps", v.accumulation},
              {"gradient_clipping", 0.05},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.004}, {"weight_decay", 0.01}}}}},
              {"trainer",
               {{"env_type", env},
                {"max_steps", steps},
                {"eval_interval", 0},
                {"log_interval", 100},
                {"progress_bar", false},
                {"comm_timeout", 30},
                {"seed", 5},
                {"experiments_dir", (dir / "exp").string()},
                {"save_dir", (dir / "ckpt").string()}}}};
  if (env == "deepspeed") doc["zero_optimization"] = zero_block(v);
  return config_from_json(doc, "test", world);
}

void write_losses(const fs::path& file, const std::vector<double>& losses) {
  std::ofstream(file) << json(losses).dump();
}

std::vector<double> read_losses(const fs::path& file) {
  std::ifstream in(file);
  EXPECT_TRUE(in.good()) << file;
  json j;
  in >> j;
  return j.get<std::vector<double>>();
}

/// Trains `steps` steps at `world` ranks with `v` (env_type deepspeed) or env_type pytorch
/// (world 1, v ignored); rank 0's losses go to `out`. `adjust` edits each rank's config.
template <class Adjust>
void train_ranks(const fs::path& dir, int world, const std::string& env, const Variant& v, int64_t steps,
                 const fs::path& out, Adjust adjust) {
  const int port = free_port();
  auto status = run_ranks(world, std::chrono::seconds(240), [&](int rank) {
    Config cfg = run_config(dir, world, env, v, steps);
    adjust(cfg);
    MlpTrainer trainer(cfg);
    if (env == "deepspeed")
      trainer.set_backend(std::make_unique<ZeroBackend>(
          cfg, make_gloo_communicator(rank, world, "127.0.0.1", port, std::chrono::seconds(30))));
    WaveSource data(240);
    const auto res = trainer.train(std::make_shared<Mlp>(), data);
    if (rank == 0) write_losses(out, res.losses);
    return 0;
  });
  for (int r = 0; r < world; ++r) ASSERT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
}

void train_ranks(const fs::path& dir, int world, const std::string& env, const Variant& v, int64_t steps,
                 const fs::path& out) {
  train_ranks(dir, world, env, v, steps, out, [](Config&) {});
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
  std::printf("[zero] %s: worst relative loss difference %.3g over %zu steps\n", what.c_str(), worst, got.size());
  std::fflush(stdout);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), rel * std::abs(want[i])) << what << " step " << i + 1 << ": " << got[i]
                                                                   << " vs " << want[i];
}

TEST(ZeroLayout, PaddingStraddlingAndEmptyPartitions) {
  const auto l = make_zero_layout({"a", "b", "c"}, {{4, 13}, {13, 7}, {7}}, 3);
  EXPECT_EQ(l.total, 52 + 91 + 7);
  EXPECT_EQ(l.padded, 192);  // a multiple of 3 x 16
  EXPECT_EQ(l.part, 64);
  const auto r1 = l.owned(1);  // [64, 128): inside b only
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].entry, 1u);
  EXPECT_EQ(r1[0].param_begin, 12);
  EXPECT_EQ(r1[0].length, 64);
  const auto r2 = l.owned(2);  // [128, 192): b's tail, c, padding
  ASSERT_EQ(r2.size(), 2u);
  EXPECT_EQ(r2[0].param_begin, 76);
  EXPECT_EQ(r2[0].length, 15);
  EXPECT_EQ(r2[1].entry, 2u);
  EXPECT_EQ(l.owned_elements(2), 22);
  const auto tiny = make_zero_layout({"x", "y"}, {{2}, {3}}, 3);
  EXPECT_EQ(tiny.part, 16);
  EXPECT_EQ(tiny.owned(0).size(), 2u);
  EXPECT_TRUE(tiny.owned(1).empty());
  EXPECT_TRUE(tiny.owned(2).empty());
  EXPECT_EQ(tiny.owned_elements(2), 0);
}

// The contract: every stage, with and without offload, at 1-4 ranks, against one process.
TEST(ZeroContract, EveryStageAndWorldSizeMatchesOneProcess) {
  polytrain::testing::TempDir s;
  const int64_t steps = 50;
  train_ranks(s.path / "ref", 1, "pytorch", Variant{}, steps, s.path / "ref.json");
  const auto ref = read_losses(s.path / "ref.json");
  ASSERT_EQ(ref.size(), static_cast<size_t>(steps));
  EXPECT_LT(ref.back(), ref.front() * 0.8) << "the reference run does not learn";
  std::printf("[zero] reference loss: step 1 %.5f, step %lld %.5f\n", ref.front(), (long long)steps, ref.back());
  std::fflush(stdout);  // before forking: the ranks must not inherit a full buffer
  for (int world : {1, 2, 3, 4}) {
    for (const Variant v : {Variant{0, false}, Variant{1, false}, Variant{2, false}, Variant{2, true}}) {
      const std::string tag = "stage" + std::to_string(v.stage) + (v.offload ? "_offload" : "") + "_world" +
                              std::to_string(world);
      train_ranks(s.path / tag, world, "deepspeed", v, steps, s.path / (tag + ".json"));
      expect_close(read_losses(s.path / (tag + ".json")), ref, 1e-5, tag);
    }
  }
}

TEST(ZeroContract, Stage1AndStage2AreBitIdentical) {
  polytrain::testing::TempDir s;
  for (int world : {2, 3}) {
    const std::string w = std::to_string(world);
    train_ranks(s.path / ("s1_" + w), world, "deepspeed", Variant{1, false, 1}, 20, s.path / ("s1_" + w + ".json"));
    train_ranks(s.path / ("s2_" + w), world, "deepspeed", Variant{2, false, 1}, 20, s.path / ("s2_" + w + ".json"));
    const auto a = read_losses(s.path / ("s1_" + w + ".json")), b = read_losses(s.path / ("s2_" + w + ".json"));
    ASSERT_EQ(a.size(), 20u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "world " << world << " step " << i + 1;
  }
}

// Each rank checks that its re-sliced state equals the consolidated saved state bit for bit.
int check_resliced(ZeroBackend& zero, const fs::path& ckpt_dir, const std::string& tag) {
  const CheckpointReader ck(ckpt_dir.string(), tag);
  const ZeroConsolidated saved = consolidate_zero_shards(ShardReader(ck));
  const auto mine = zero.owned_state();
  if (mine.step != saved.step) return std::fprintf(stderr, "step %lld vs %lld\n", (long long)mine.step, (long long)saved.step), 3;
  int64_t off = 0;
  for (size_t i = 0; i < mine.names.size(); ++i) {
    const ZeroParamState* p = nullptr;
    for (const auto& [n, st] : saved.params)
      if (n == mine.names[i]) p = &st;
    if (p == nullptr) return 4;
    const int64_t len = mine.lengths[i];
    const auto want_m = p->master.reshape({-1}).narrow(0, mine.begins[i], len);
    if (!torch::equal(mine.master.narrow(0, off, len), want_m) ||
        !torch::equal(mine.exp_avg.narrow(0, off, len), p->exp_avg.reshape({-1}).narrow(0, mine.begins[i], len)) ||
        !torch::equal(mine.exp_avg_sq.narrow(0, off, len), p->exp_avg_sq.reshape({-1}).narrow(0, mine.begins[i], len)))
      return std::fprintf(stderr, "state of %s differs\n", mine.names[i].c_str()), 5;
    off += len;
  }
  return off == mine.master.numel() ? 0 : 6;
}

TEST(ZeroCheckpoint, SavedAtTwoRanksResumesAtOneAndThree) {
  polytrain::testing::TempDir s;
  const Variant v{2, true};
  // Uninterrupted: 10 steps at 2 ranks, checkpoints at 5 and 10.
  train_ranks(s.path / "two", 2, "deepspeed", v, 10, s.path / "two.json",
              [](Config& c) { c.trainer.save_interval = 5, c.trainer.keep_last = 0; });
  const auto full = read_losses(s.path / "two.json");
  ASSERT_EQ(full.size(), 10u);
  const fs::path ckpt = s.path / "two" / "ckpt";
  ASSERT_TRUE(fs::exists(ckpt / "global_step5" / "shard_1.pt"));
  std::ofstream(ckpt / "latest") << "global_step5\n";
  for (int world : {1, 3}) {
    const std::string w = std::to_string(world);
    // Loading only (max_steps 5 = the checkpoint's step): the state each rank re-sliced.
    const int port = free_port();
    auto status = run_ranks(world, std::chrono::seconds(120), [&](int rank) {
      Config cfg = run_config(s.path / ("load" + w), world, "deepspeed", v, 5);
      cfg.trainer.load_dir = ckpt.string();
      MlpTrainer trainer(cfg);
      auto backend = std::make_unique<ZeroBackend>(
          cfg, make_gloo_communicator(rank, world, "127.0.0.1", port, std::chrono::seconds(30)));
      ZeroBackend* zero = backend.get();
      trainer.set_backend(std::move(backend));
      WaveSource data(240);
      trainer.train(std::make_shared<Mlp>(), data);
      return check_resliced(*zero, ckpt, "global_step5");
    });
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "world " << w << " rank " << r << " status "
                                                                      << status[r];
    // Training on: the next 5 losses as the uninterrupted run's.
    train_ranks(s.path / ("resume" + w), world, "deepspeed", v, 10, s.path / ("resume" + w + ".json"),
                [&](Config& c) { c.trainer.load_dir = ckpt.string(); });
    expect_close(read_losses(s.path / ("resume" + w + ".json")), std::vector<double>(full.begin() + 5, full.end()),
                 1e-5, "resumed at " + w);
  }
  // The export from the shards equals the saved (gathered) model bit for bit.
  std::string out;
  const std::string exported = (s.path / "model.safetensors").string();
  ASSERT_EQ(polytrain::testing::run_command(std::string(POLYTRAIN_BINARY_DIR) + "/zero_to_fp32 " + ckpt.string() +
                                                " " + exported + " --tag global_step5 2>&1",
                                            &out),
            0)
      << out;
  EXPECT_NE(out.find("171 elements from 2 ZeRO shards"), std::string::npos) << out;
  NamedTensors model;
  CheckpointReader(ckpt.string(), "global_step5").read_archive("state.pt", [&](torch::serialize::InputArchive& a) {
    torch::serialize::InputArchive m;
    a.read("model", m);
    model = load_named_tensors_archive(m);
  });
  const auto loaded = load_safetensors(exported);
  ASSERT_EQ(loaded.size(), model.size());
  for (const auto& [name, t] : model) {
    auto it = std::find_if(loaded.begin(), loaded.end(), [&](const auto& p) { return p.first == name; });
    ASSERT_NE(it, loaded.end()) << name;
    EXPECT_TRUE(torch::equal(it->second, t)) << name;
  }
}

// ---- in-process ranks (threads) for accounting ------------------------------------------

struct Wide : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Wide() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(64, 96));  // 6144 + 96
    b = register_module("b", torch::nn::Linear(96, 5));   // 480 + 5
  }
  at::Tensor loss(const at::Tensor& x) { return b(torch::relu(a(x))).pow(2).mean(); }
};

Config wide_config(int world, const Variant& v, int64_t bucket) {
  json z = {{"stage", v.stage}, {"reduce_bucket_size", bucket}, {"overlap_comm", true}};
  if (v.offload) z["offload_optimizer"] = {{"device", "cpu"}};
  json doc = {{"train_batch_size", 8 * world},
              {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}},
              {"zero_optimization", z},
              {"trainer", {{"env_type", "deepspeed"}}}};
  return config_from_json(doc, "test", world);
}

template <class F>
void on_threads(int world, F body) {
  const int port = free_port();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([=] { body(r, make_gloo_communicator(r, world, "127.0.0.1", port, std::chrono::seconds(60))); });
  for (auto& t : threads) t.join();
}

TEST(ZeroMemory, OptimizerStateAndGradientsAreTheirShare) {
  at::set_num_threads(1);
  for (int world : {1, 2, 4}) {
    for (const Variant v : {Variant{1, false}, Variant{2, false}, Variant{2, true}}) {
      on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
        const int64_t bucket = 1000;
        auto cfg = wide_config(world, v, bucket);
        ZeroBackend zero(cfg, std::move(comm));
        auto model = std::make_shared<Wide>();
        zero.prepare(model, cfg);
        // Run a step so every buffer exists as it will during training.
        zero.backward(model->loss(torch::randn({8, 64})), MicroStep{8, true});
        zero.step(StepRequest{0.01}, 0);
        int64_t padded = 0, largest_param = 0;
        for (const auto& l : zero.layouts()) {
          padded += l.padded;
          for (const auto& e : l.entries) largest_param = std::max(largest_param, e.numel);
        }
        const ZeroMemory m = zero.memory();
        const std::string what = "world " + std::to_string(world) + " stage " + std::to_string(v.stage) +
                                 (v.offload ? " offload" : "") + " rank " + std::to_string(rank);
        EXPECT_EQ(m.params, 4 * padded) << what;
        EXPECT_EQ(m.optimizer_state, 8 * padded / world) << what;  // Adam's two moments, this rank's share
        EXPECT_EQ(m.master, v.offload ? 4 * padded / world : 0) << what;  // fp32 params are their own master
        if (v.stage == 1) {
          EXPECT_EQ(m.gradients, 4 * padded) << what;
          EXPECT_EQ(m.reduce_buffers, 0) << what;
        } else {
          EXPECT_EQ(m.gradients, 4 * padded / world) << what;
          EXPECT_LE(m.reduce_buffers, 2 * 4 * (bucket + largest_param)) << what;  // two reduce buffers
        }
        EXPECT_EQ(m.host_copies, v.offload ? 4 * padded / world : 0) << what;
      });
    }
  }
}

TEST(ZeroComm, BytesPerStepAreTwiceTheParametersAsDdp) {
  at::set_num_threads(1);
  const int world = 2;
  int64_t zero_bytes = 0, ddp_bytes = 0, total = 0, padded = 0;
  on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
    auto counting = std::make_unique<CountingCommunicator>(std::move(comm));
    CountingCommunicator* c = counting.get();
    auto cfg = wide_config(world, Variant{2, false}, 1000);
    ZeroBackend zero(cfg, std::move(counting));
    auto model = std::make_shared<Wide>();
    zero.prepare(model, cfg);
    c->reset();
    zero.backward(model->loss(torch::randn({8, 64})), MicroStep{8, true});
    zero.step(StepRequest{0.01}, 0);
    if (rank == 0) {
      zero_bytes = c->reduce_bytes + c->gather_bytes;  // the norm's 8-byte all-reduce left out
      for (const auto& l : zero.layouts()) total += l.total, padded += l.padded;
    }
  });
  on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
    auto counting = std::make_unique<CountingCommunicator>(std::move(comm));
    CountingCommunicator* c = counting.get();
    Config cfg = wide_config(world, Variant{2, false}, 1000);
    cfg.trainer.env_type = "pytorchDDP";
    DdpBackend ddp(cfg, std::move(counting));
    auto model = std::make_shared<Wide>();
    ddp.prepare(model, cfg);
    c->reset();
    ddp.backward(model->loss(torch::randn({8, 64})), MicroStep{8, true});
    ddp.step(StepRequest{0.01}, 0);
    if (rank == 0) ddp_bytes = c->all_reduce_bytes;
  });
  EXPECT_EQ(total, 6144 + 96 + 480 + 5);
  EXPECT_EQ(zero_bytes, 4 * (total + padded));  // reduce of every gradient + gather of the padded partitions
  EXPECT_EQ(ddp_bytes, 2 * 4 * total);
  EXPECT_LE(std::abs(zero_bytes - ddp_bytes), 4 * (padded - total));
}

// ---- stage 3 --------------------------------------------------------------------------------

// A layer loop as the model families have it: an input projection, 4 blocks run through
// in_layer, a head. Each block checks, while it runs, which blocks hold their parameters.
struct Block3 : torch::nn::Module, LayerUnit {
  torch::nn::Linear lin{nullptr};
  Block3() { lin = register_module("lin", torch::nn::Linear(48, 48)); }
};
struct Stack3 : torch::nn::Module {
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::function<void(size_t)> inside;  // called in block i's forward
  std::vector<size_t> order = {0, 1, 2, 3};  // the blocks as the loop runs them (ALBERT: one, many times)
  Stack3() {
    in = register_module("in", torch::nn::Linear(16, 48));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(std::make_shared<Block3>());
    out = register_module("out", torch::nn::Linear(48, 3));
    // Its own generator: ranks run as threads here, and the global one is shared.
    auto gen = at::detail::createCPUGenerator(11);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
  }
  at::Tensor loss(const at::Tensor& x, bool checkpoint = false) {
    at::Tensor h = in(x);
    for (size_t i : order) {
      auto* b = blocks->ptr<Block3>(i).get();
      auto run = [&, b, i](const at::Tensor& t) {
        return in_layer(*b, [&] {
          if (inside) inside(i);
          return torch::tanh(b->lin(t));
        });
      };
      h = checkpoint ? checkpointed(run, h) : run(h);
    }
    return out(h).pow(2).mean();
  }
};

// `coordinator`: stage3_prefetch_bucket_size, stage3_max_reuse_distance and
// stage3_max_live_parameters when given (DeepSpeed's defaults otherwise).
Config stage3_config(int world, int64_t threshold, const json& coordinator = json::object()) {
  json z = {{"stage", 3}, {"reduce_bucket_size", 500}, {"allgather_bucket_size", 1000},
            {"stage3_param_persistence_threshold", threshold}};
  z.update(coordinator);
  json doc = {{"train_batch_size", 8 * world},
              {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}},
              {"zero_optimization", z},
              {"trainer", {{"env_type", "deepspeed"}}}};
  return config_from_json(doc, "test", world);
}

// Rank `rank`'s batch of step `step` (its own generator: ranks run as threads here).
at::Tensor stage3_batch(int world, int rank, int step) {
  return torch::randn({8, 16}, at::detail::createCPUGenerator(100 + step * world + rank));
}

struct LambdaRunner : MicroBatchRunner {
  std::function<at::Tensor()> f;
  at::Tensor forward(int64_t) override { return f(); }
};

// The one-process run of the same 3 steps (Adam, the mean over the ranks' batches): its losses.
std::vector<double> stage3_reference(int world, const std::vector<size_t>& order = {0, 1, 2, 3}) {
  auto model = std::make_shared<Stack3>();
  model->order = order;
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  std::vector<double> out;
  for (int step = 0; step < 3; ++step) {
    adam.zero_grad();
    for (int r = 0; r < world; ++r) {
      const at::Tensor l = model->loss(stage3_batch(world, r, step));
      if (r == 0) out.push_back(l.item<double>());
      (l / world).backward();
    }
    adam.step();
  }
  return out;
}

// At 2 ranks, without prefetch or reuse: each block holds its parameters only while it runs
// (forward, and backward, with and without activation checkpointing); between steps only the
// owned partitions remain; the first step gathers the layers twice (forward, backward; three
// times checkpointed) and the rest once, the later ones keep the last block from its forward to
// its backward (asked again at once: a reuse distance of 0); the gradients are reduced once;
// the trajectory equals one process's.
TEST(ZeroStage3, LayersAreGatheredOnlyWhileTheyRunAndTheTrafficIsThreeTimesTheParameters) {
  at::set_num_threads(1);
  const int world = 2;
  std::vector<double> losses[2];
  for (bool checkpoint : {false, true}) {
    on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
      auto counting = std::make_unique<CountingCommunicator>(std::move(comm));
      CountingCommunicator* c = counting.get();
      auto cfg = stage3_config(world, 0, {{"stage3_prefetch_bucket_size", 0}, {"stage3_max_reuse_distance", 0}});
      ZeroBackend zero(cfg, std::move(counting));
      auto model = std::make_shared<Stack3>();
      zero.prepare(model, cfg);
      ASSERT_EQ(zero.unit_count(), 6u);  // outside the layers, 4 blocks, persistent (empty)
      for (size_t u = 0; u < zero.unit_count(); ++u) EXPECT_EQ(zero.unit_gathered(u), u == 5) << "unit " << u;
      int64_t layers = 0, rest = 0, total = 0;
      for (const auto& l : zero.layouts()) {
        (l.entries.front().name.rfind("blocks.", 0) == 0 ? layers : rest) += l.padded;
        total += l.total;
      }
      int wrong = 0;
      model->inside = [&](size_t i) {
        for (size_t b = 0; b < 4; ++b) wrong += zero.unit_gathered(1 + b) != (b == i);
        wrong += !zero.unit_gathered(0);  // the parameters outside the layers: the whole step
      };
      for (int step = 0; step < 3; ++step) {
        c->reset();
        const at::Tensor x = stage3_batch(world, rank, step);
        LambdaRunner runner;
        runner.f = [&] {
          at::Tensor l = model->loss(x, checkpoint);
          if (rank == 0) losses[checkpoint].push_back(l.item<double>());
          return l;
        };
        zero.run_micro_batches(runner);
        zero.step(StepRequest{0.01}, step);
        for (size_t u = 0; u < 5; ++u) EXPECT_FALSE(zero.unit_gathered(u)) << "unit " << u << " after step " << step;
        // The first step: checkpointed blocks are gathered a third time, for the recomputation
        // in backward. Later: every block twice but the last, kept (its next request follows).
        const int64_t blocks = step == 0 ? (checkpoint ? 12 : 8) : 7;
        EXPECT_EQ(c->gather_bytes, 4 * (blocks * layers / 4 + rest)) << "step " << step;
        EXPECT_EQ(c->reduce_bytes, 4 * total) << "step " << step;
      }
      EXPECT_EQ(wrong, 0);
      EXPECT_EQ(zero.prefetched(), 0u);
      const ZeroMemory m = zero.memory();
      EXPECT_EQ(m.params, 4 * (layers + rest) / world);  // the owned partitions only
      EXPECT_EQ(m.gathered_params, 0);
      // At most the parameters outside the layers and two blocks at once (a block's backward
      // gathers it before the one after it has let go).
      EXPECT_LE(m.gathered_params_peak, 4 * (rest + 2 * layers / 4));
      EXPECT_GE(m.gathered_params_peak, 4 * (rest + layers / 4));
      // Eval and export hold the whole model, then let go.
      const auto state = zero.full_state(*model);
      EXPECT_EQ(state.size(), 12u);
      for (size_t u = 0; u < 5; ++u) EXPECT_FALSE(zero.unit_gathered(u));
      zero.begin_eval();
      {
        torch::NoGradGuard no_grad;
        model->inside = nullptr;
        (void)model->loss(torch::randn({8, 16}));
      }
      zero.end_eval();
      for (size_t u = 0; u < 5; ++u) EXPECT_FALSE(zero.unit_gathered(u));
    });
  }
  const auto ref = stage3_reference(world);
  for (int step = 0; step < 3; ++step) {
    EXPECT_NEAR(losses[0][step], ref[step], 1e-6 * std::abs(ref[step])) << "step " << step;
    EXPECT_NEAR(losses[1][step], ref[step], 1e-6 * std::abs(ref[step])) << "checkpointed, step " << step;
  }
}

// DeepSpeed's parameter coordinator at its defaults (prefetch 5e7 elements, reuse distance and
// live parameters 1e9): after the first step (the trace) each block is gathered once per step,
// ahead of its request (prefetched), and kept from its forward to its backward. With
// stage3_max_live_parameters at 1 element nothing is gathered ahead or kept: every block twice
// a step, at most two at once. The losses are one process's either way.
TEST(ZeroStage3, PrefetchAndReuseFollowTheFirstStepsTrace) {
  at::set_num_threads(1);
  const int world = 2;
  const auto ref = stage3_reference(world);
  for (bool limited : {false, true}) {
    on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
      auto counting = std::make_unique<CountingCommunicator>(std::move(comm));
      CountingCommunicator* c = counting.get();
      auto cfg = stage3_config(world, 0, limited ? json{{"stage3_max_live_parameters", 1}} : json::object());
      ZeroBackend zero(cfg, std::move(counting));
      auto model = std::make_shared<Stack3>();
      zero.prepare(model, cfg);
      int64_t layers = 0, rest = 0;
      for (const auto& l : zero.layouts()) (l.entries.front().name.rfind("blocks.", 0) == 0 ? layers : rest) += l.padded;
      for (int step = 0; step < 3; ++step) {
        c->reset();
        const at::Tensor x = stage3_batch(world, rank, step);
        LambdaRunner runner;
        runner.f = [&] {
          at::Tensor l = model->loss(x);
          if (rank == 0) EXPECT_NEAR(l.item<double>(), ref[step], 1e-6 * std::abs(ref[step])) << "step " << step;
          return l;
        };
        zero.run_micro_batches(runner);
        zero.step(StepRequest{0.01}, step);
        for (size_t u = 0; u < 5; ++u) EXPECT_FALSE(zero.unit_gathered(u)) << "unit " << u << " after step " << step;
        const int64_t gathers = step == 0 || limited ? 2 : 1;
        EXPECT_EQ(c->gather_bytes, 4 * (gathers * layers + rest)) << "step " << step << (limited ? " (limited)" : "");
      }
      if (!limited) {
        EXPECT_EQ(zero.prefetched(), 6u);  // blocks 2, 3, 4 at block 1's request, in steps 2 and 3
        EXPECT_EQ(zero.memory().gathered_params_peak, 4 * (layers + rest));
      } else {
        EXPECT_EQ(zero.prefetched(), 0u);
        EXPECT_LE(zero.memory().gathered_params_peak, 4 * (rest + 2 * layers / 4));
      }
    });
  }
}

// Blocks applied more than once per forward, as ALBERT's shared layers are (here 0, 1, 0, 1, 2,
// 3), with and without activation checkpointing, without the coordinator and at its defaults:
// the losses are one process's, and between steps only the partitions remain.
TEST(ZeroStage3, BlocksAppliedTwiceAsAlbertsSharedLayersFollowOneProcess) {
  at::set_num_threads(1);
  const int world = 2;
  const std::vector<size_t> order = {0, 1, 0, 1, 2, 3};
  const auto ref = stage3_reference(world, order);
  for (bool checkpoint : {false, true})
    for (bool coordinator : {false, true}) {
      on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
        auto cfg = stage3_config(world, 0,
                                 coordinator ? json::object()
                                             : json{{"stage3_prefetch_bucket_size", 0}, {"stage3_max_reuse_distance", 0}});
        ZeroBackend zero(cfg, std::move(comm));
        auto model = std::make_shared<Stack3>();
        model->order = order;
        zero.prepare(model, cfg);
        for (int step = 0; step < 3; ++step) {
          const at::Tensor x = stage3_batch(world, rank, step);
          LambdaRunner runner;
          runner.f = [&] {
            at::Tensor l = model->loss(x, checkpoint);
            if (rank == 0)
              EXPECT_NEAR(l.item<double>(), ref[step], 1e-6 * std::abs(ref[step]))
                  << "step " << step << (checkpoint ? ", checkpointed" : "") << (coordinator ? ", coordinator" : "");
            return l;
          };
          zero.run_micro_batches(runner);
          zero.step(StepRequest{0.01}, step);
          for (size_t u = 0; u < 5; ++u) EXPECT_FALSE(zero.unit_gathered(u)) << "unit " << u << " after step " << step;
        }
      });
    }
}

// Parameters below stage3_param_persistence_threshold stay whole on every rank (the biases
// here): their unit is never let go and they are updated and broadcast as at stage 2.
TEST(ZeroStage3, ParametersBelowThePersistenceThresholdStayWhole) {
  at::set_num_threads(1);
  on_threads(2, [&](int rank, std::unique_ptr<Communicator> comm) {
    auto cfg = stage3_config(2, 100);
    ZeroBackend zero(cfg, std::move(comm));
    auto model = std::make_shared<Stack3>();
    zero.prepare(model, cfg);
    ASSERT_EQ(zero.unit_count(), 6u);
    EXPECT_TRUE(zero.unit_gathered(5));
    int64_t persistent = 0;
    for (const auto& l : zero.layouts())
      if (l.entries.front().name.find("bias") != std::string::npos) persistent += l.padded;
    EXPECT_EQ(persistent, 256);  // 48 + 4 x 48 + 3 bias elements in one group, padded to a multiple of 2 x 16
    const at::Tensor before = model->blocks->ptr<Block3>(2)->lin->bias.detach().clone();
    struct Runner : MicroBatchRunner {
      Stack3* m;
      at::Tensor forward(int64_t) override { return m->loss(torch::randn({8, 16})); }
    } runner;
    runner.m = model.get();
    zero.run_micro_batches(runner);
    zero.step(StepRequest{0.01}, 0);
    const at::Tensor after = model->blocks->ptr<Block3>(2)->lin->bias.detach();
    EXPECT_FALSE(torch::equal(before, after));  // readable between steps, and updated
    (void)rank;
  });
}

TEST(ZeroStep, ANonFiniteGradientOnOneRankSkipsOnEvery) {
  at::set_num_threads(1);
  on_threads(3, [&](int rank, std::unique_ptr<Communicator> comm) {
    auto cfg = wide_config(3, Variant{2, false}, 1000);
    ZeroBackend zero(cfg, std::move(comm));
    auto model = std::make_shared<Wide>();
    zero.prepare(model, cfg);
    const auto before = model->a->weight.clone();
    auto loss = model->loss(torch::randn({8, 64}));
    if (rank == 1) loss = loss * std::numeric_limits<float>::infinity();
    zero.backward(loss, MicroStep{8, true});
    const auto r = zero.step(StepRequest{0.01}, 0);
    EXPECT_EQ(r.outcome, StepOutcome::kSkippedNonFinite) << "rank " << rank;
    EXPECT_TRUE(torch::equal(model->a->weight, before)) << "rank " << rank;
    // The next, finite step applies everywhere.
    zero.backward(model->loss(torch::randn({8, 64})), MicroStep{8, true});
    EXPECT_EQ(zero.step(StepRequest{0.01}, 0).outcome, StepOutcome::kApplied) << "rank " << rank;
  });
}

// Half-precision parameters (a model converted to bf16): ZeRO keeps fp32 master weights for
// the owned partition (in CPU memory with offload), and the CPU Adam writes the updated weights
// back as bf16 in the same pass; every rank ends with the same bf16 model, each element the
// bf16 rounding of its owner's fp32 master.
TEST(ZeroHalf, Bf16ParametersKeepFp32MastersAndCopyOut) {
  at::set_num_threads(1);
  const int world = 2;
  std::vector<at::Tensor> flat(world);
  std::vector<ZeroBackend::OwnedState> owned(world);
  int64_t padded = 0;
  on_threads(world, [&](int rank, std::unique_ptr<Communicator> comm) {
    auto cfg = wide_config(world, Variant{2, true}, 1000);
    ZeroBackend zero(cfg, std::move(comm));
    auto model = std::make_shared<Wide>();
    model->to(torch::kBFloat16);
    zero.prepare(model, cfg);
    torch::manual_seed(11 + rank);
    const auto before = model->a->weight.clone();
    for (int s = 0; s < 3; ++s) {
      zero.backward(model->loss(torch::randn({8, 64}).to(torch::kBFloat16)).to(torch::kFloat), MicroStep{8, true});
      EXPECT_EQ(zero.step(StepRequest{0.01}, s).outcome, StepOutcome::kApplied);
    }
    EXPECT_EQ(model->a->weight.scalar_type(), torch::kBFloat16);
    EXPECT_FALSE(torch::equal(model->a->weight, before)) << "rank " << rank << ": not updated";
    std::vector<at::Tensor> parts;
    for (const auto& item : model->named_parameters()) parts.push_back(item.value().detach().reshape({-1}).clone());
    flat[rank] = torch::cat(parts);
    owned[rank] = zero.owned_state();
    const ZeroMemory m = zero.memory();
    if (rank == 0)
      for (const auto& l : zero.layouts()) padded += l.padded;
    EXPECT_EQ(owned[rank].step, 3);
    EXPECT_GT(m.master, 0);
    // Each owned piece's bf16 parameter is its fp32 master rounded.
    int64_t off = 0;
    for (size_t i = 0; i < owned[rank].names.size(); ++i) {
      at::Tensor p = model->named_parameters()[owned[rank].names[i]].detach().reshape({-1});
      const auto mine = p.narrow(0, owned[rank].begins[i], owned[rank].lengths[i]);
      EXPECT_TRUE(torch::equal(mine, owned[rank].master.narrow(0, off, mine.numel()).to(torch::kBFloat16)))
          << owned[rank].names[i];
      off += mine.numel();
    }
  });
  EXPECT_TRUE(torch::equal(flat[0], flat[1])) << "ranks hold different models";
  EXPECT_EQ(owned[0].master.numel() + owned[1].master.numel(), 6144 + 96 + 480 + 5);
  EXPECT_GT(padded, 0);
}

// One layer applied twice, each application checkpointed (ALBERT's shared layers under
// activation checkpointing): its gradient is accumulated once per block, in nested backwards,
// so stage 2's hooks see it twice; what comes after its bucket was reduced is reduced again.
struct SharedTwice : torch::nn::Module {
  torch::nn::Linear shared{nullptr}, head{nullptr};
  SharedTwice() {
    shared = register_module("shared", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 1));
    // Deterministic weights: ranks are threads here, and the global generator is shared.
    torch::NoGradGuard no_grad;
    int i = 0;
    for (auto& p : parameters())
      p.copy_((torch::sin(torch::arange(p.numel()).to(torch::kFloat) * 0.37 + ++i) * 0.3).view_as(p));
  }
  at::Tensor loss(const at::Tensor& x) {
    auto block = [this](const at::Tensor& h) { return torch::tanh(shared(h)); };
    return head(checkpointed(block, checkpointed(block, x))).pow(2).mean();
  }
};

// Step s's micro-batch of rank r, without the (shared) global generator.
at::Tensor batch_of(int s, int rank) {
  return torch::sin(torch::arange(128).to(torch::kFloat).view({8, 16}) * (0.1 + 0.05 * s) + rank);
}

// Three steps of SharedTwice on 2 thread ranks under backend B configured by `doc`; each
// rank's parameters, flattened.
template <class B>
std::vector<at::Tensor> train_shared_on(const json& doc) {
  std::vector<at::Tensor> out(2);
  on_threads(2, [&](int rank, std::unique_ptr<Communicator> comm) {
    const Config cfg = config_from_json(doc, "test", 2);
    B backend(cfg, std::move(comm));
    auto model = std::make_shared<SharedTwice>();
    backend.prepare(model, cfg);
    for (int s = 0; s < 3; ++s) {
      backend.backward(model->loss(batch_of(s, rank)), MicroStep{8, true});
      backend.step(StepRequest{0.01}, s);
    }
    std::vector<at::Tensor> parts;
    for (const auto& p : model->parameters()) parts.push_back(p.detach().reshape({-1}).clone());
    out[rank] = torch::cat(parts);
  });
  return out;
}

at::Tensor train_shared(int stage, bool overlap) {
  const auto out = train_shared_on<ZeroBackend>(
      {{"train_batch_size", 16},
       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
       {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 20}, {"overlap_comm", overlap}}},
       {"trainer", {{"env_type", "deepspeed"}}}});
  EXPECT_TRUE(torch::equal(out[0], out[1]));
  return out[0];
}

TEST(ZeroStage2, SharedCheckpointedLayerAccumulatedTwiceIsReducedWhole) {
  at::set_num_threads(1);
  const auto one = train_shared(1, false), late = train_shared(2, true), after = train_shared(2, false);
  EXPECT_LT((late - one).abs().max().item<double>(), 1e-6);
  EXPECT_LT((after - one).abs().max().item<double>(), 1e-6);
}

at::Tensor train_shared_ddp(bool overlap) {
  return train_shared_on<DdpBackend>(
      {{"train_batch_size", 16},
       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
       {"trainer", {{"env_type", "pytorchDDP"}, {"reduce_bucket_size", 80}, {"overlap_comm", overlap}}}})[0];
}

TEST(DdpStatic, SharedCheckpointedLayerWithOverlapEqualsWithout) {
  at::set_num_threads(1);
  const auto a = train_shared_ddp(true), b = train_shared_ddp(false), z = train_shared(1, false);
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-6);
  EXPECT_LT((b - z).abs().max().item<double>(), 1e-6);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

TEST(ZeroConfig, ErrorsNameTheKey) {
  auto make = [](json z, std::string opt = "AdamW") {
    json doc = {{"train_batch_size", 8},
                {"optimizer", {{"type", opt}}},
                {"zero_optimization", z},
                {"trainer", {{"env_type", "deepspeed"}}}};
    return config_from_json(doc, "test", 1);
  };
  EXPECT_NE(error_of([&] { make({{"stage", 2}, {"allgather_bucket_size", 7}}); }).find("allgather_bucket_size"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}}}); })
                .find("ratio < 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make({{"stage", 2}, {"no_such_key", 1}}); }).find("no_such_key"), std::string::npos);
  auto backend_error = [&](json z, std::string opt = "AdamW") {
    return error_of([&] {
      Config c = make(z, opt);
      ZeroBackend zero(c, make_gloo_communicator(0, 1, "127.0.0.1", free_port(), std::chrono::seconds(30)));
      zero.prepare(std::make_shared<Wide>(), c);
    });
  };
  EXPECT_NE(backend_error({{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}).find("offload_param needs stage 3, got stage 2"),
            std::string::npos);
  EXPECT_NE(backend_error({{"stage", 3}, {"offload_param", {{"device", "nvme"}, {"nvme_path", "/tmp"}}}}).find("'nvme' is not"),
            std::string::npos);
  EXPECT_NE(backend_error({{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}).find("stage 1, 2 or 3"),
            std::string::npos);
  EXPECT_NE(backend_error({{"stage", 2}}, "Lamb").find("LAMB's trust ratio"), std::string::npos);
  EXPECT_NE(backend_error({{"stage", 2}}, "SGD").find("use Adam or AdamW"), std::string::npos);
}

}  // namespace
