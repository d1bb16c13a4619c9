// The Trainer loop against the Backend interface, with ranks as real processes over Gloo on
// loopback (forked, each with a deadline, ended by pid): a 2 x 2 process grid whose groups are
// Megatron's and whose data shard follows the data-parallel size (every sample of each global
// batch read exactly once, tensor-parallel peers reading the same samples); a sharded save
// with a rank SIGKILLed in the middle leaves the previous checkpoint loadable, and a folder
// without its completion marker is refused; a step of micro-batches 8, 8, 4 makes the same
// update as one micro-batch of 20 (loss normalised by samples); evaluate() before train().
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <tuple>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/crc32c.h"
#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/parallel/ddp/ddp_backend.h"
#include "polytrain/parallel/process_grid.h"
#include "polytrain/parallel/single/single_backend.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/checkpoint/checkpoint_marker.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using polytrain::testing::free_port;
using polytrain::testing::run_ranks;

using Scratch = polytrain::testing::TempDir;

// Sample i: x = features of i, y = a fixed linear function of x; "index" carries i.
class LinearSource : public BatchSource {
 public:
  explicit LinearSource(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t /*epoch*/) const override {
    auto idx = torch::tensor(indices, torch::kLong);
    auto f = idx.to(torch::kDouble).unsqueeze(1);
    auto x = torch::cat({torch::sin(f * 0.7), torch::cos(f * 1.3), torch::sin(f * 0.11 + 1), f.remainder(5) / 5}, 1)
                 .to(torch::kFloat);
    Batch b;
    b.set("x", x);
    b.set("y", (x * torch::tensor({1.5f, -2.0f, 0.5f, 3.0f})).sum(1, true) + 0.25);
    b.set("index", idx);
    return b;
  }

 private:
  int64_t n_;
};

struct Regression : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Regression() { lin = register_module("lin", torch::nn::Linear(4, 1)); }
};

// Mean squared error; records which samples each step read.
class LinearTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  std::vector<std::vector<int64_t>> seen;  ///< per forward_step call
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& m = dynamic_cast<Regression&>(model);
    if (model.is_training()) {
      auto idx = batch.at("index").contiguous();
      seen.emplace_back(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    }
    ModelOutput out;
    out.loss = (m.lin(batch.at("x")) - batch.at("y")).pow(2).mean();
    return out;
  }
};

Config linear_config(const fs::path& dir, int64_t global_batch, int64_t micro, int64_t world, int64_t tp = 1) {
  json doc = {{"train_batch_size", global_batch},
              {"train_micro_batch_size_per_gpu", micro},
              {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.05}}}}},
              {"trainer",
               {{"env_type", tp > 1 ? "deepspeed+mpu" : "pytorch"},
                {"model_parallel_size", tp},
                {"max_steps", 4},
                {"eval_interval", 0},
                {"log_interval", 1},
                {"progress_bar", false},
                {"comm_timeout", 20},
                {"experiments_dir", (dir / "exp").string()},
                {"save_dir", (dir / "ckpt").string()}}}};
  return config_from_json(doc, "test", world);
}

// A data-parallel backend on a TP x DP grid with the model replicated (as the tensor-parallel
// backend will be before it shards anything): gradients averaged over the DP group only, so
// the run is right only if tensor-parallel peers read the same samples.
class GridBackend : public ReplicatedBackend {
 public:
  GridBackend(const Config& cfg, std::unique_ptr<Communicator> world)
      : ReplicatedBackend(cfg), world_(std::move(world)) {
    groups_ = make_process_groups(*world_, cfg.trainer.model_parallel_size);
    ctx_.rank = world_->rank(), ctx_.world_size = world_->size();
    ctx_.tp_rank = groups_.coord.tp_rank, ctx_.tp_size = groups_.shape.tp;
    ctx_.dp_rank = groups_.coord.dp_rank, ctx_.dp_size = groups_.shape.dp;
    ctx_.writes_logs = ctx_.writes_model = ctx_.commits_checkpoints = ctx_.rank == 0;
  }
  std::string name() const override { return "grid-test"; }
  void prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) override { build(std::move(model), cfg); }
  void backward(const at::Tensor& loss, const MicroStep&) override { loss.backward(); }
  StepResult step(const StepRequest& request, int64_t step) override {
    for (auto& p : params_) groups_.dp_group->all_reduce(p.mutable_grad(), ReduceOp::kAvg);
    StepResult r = update(request, step);
    for (auto& p : params_) p.mutable_grad().zero_();
    return r;
  }
  double reduce_metric(double v) override {
    auto t = torch::tensor({v}, torch::kDouble);
    world_->all_reduce(t, ReduceOp::kAvg);
    return t.item<double>();
  }
  void barrier() override { world_->barrier(); }
  ProcessGroups groups_;

 private:
  std::unique_ptr<Communicator> world_;
};

TEST(ProcessGrid, MegatronOrderAndErrors) {
  const GridShape g = make_grid_shape(8, 2);
  EXPECT_EQ(g.dp, 4);
  EXPECT_EQ(tp_group_members(g, 5), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(dp_group_members(g, 5), (std::vector<int64_t>{1, 3, 5, 7}));
  EXPECT_EQ(grid_coord(g, 5).tp_rank, 1);
  EXPECT_EQ(grid_coord(g, 5).dp_rank, 2);
  try {
    make_grid_shape(6, 4);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model_parallel_size (4) does not divide the world size (6)"), std::string::npos)
        << e.what();
  }
  // The batch triple follows the data-parallel size: 16 = micro 2 x GA 4 x dp 2 at world 4, tp 2.
  Scratch s;
  const Config c = linear_config(s.path, 16, 2, 4, 2);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 4);
  EXPECT_EQ(c.batch.world_size, 2);
  json bad = config_to_json(c);
  bad["trainer"]["env_type"] = "pytorchDDP";
  EXPECT_THROW(config_from_json(bad, "c.json", 4), InputError);  // tp > 1 needs deepspeed+mpu
}

// 4 processes, tp 2 x dp 2: TP groups {0,1},{2,3}, DP groups {0,2},{1,3}; over 4 steps of a
// 16-sample global batch (micro 2, GA 4) the two DP members read disjoint halves that make up
// the global batch, and both ranks of a TP group read exactly the same samples.
TEST(ProcessGrid, TwoByTwoGroupsAndDataShardFollowDp) {
  if (!comm_engine_available("gloo")) GTEST_SKIP() << "built without Gloo";
  Scratch s;
  const int port = free_port();
  auto status = run_ranks(4, std::chrono::seconds(120), [&](int rank) {
    auto world = make_gloo_communicator(rank, 4, "127.0.0.1", port, std::chrono::seconds(30));
    const Config cfg = linear_config(s.path, 16, 2, 4, 2);
    auto backend = std::make_unique<GridBackend>(cfg, std::move(world));
    auto& g = backend->groups_;
    // Groups: sum of member ranks over each group equals the sum of its expected members.
    auto probe = torch::tensor({static_cast<double>(rank)}, torch::kDouble);
    auto tp = probe.clone(), dp = probe.clone();
    g.tp_group->all_reduce(tp, ReduceOp::kSum);
    g.dp_group->all_reduce(dp, ReduceOp::kSum);
    json out = {{"rank", rank},
                {"tp_rank", backend->context().tp_rank},
                {"dp_rank", backend->context().dp_rank},
                {"tp_group_size", g.tp_group->size()},
                {"dp_group_size", g.dp_group->size()},
                {"tp_sum", tp.item<double>()},
                {"dp_sum", dp.item<double>()}};
    LinearTrainer trainer(cfg);
    trainer.set_backend(std::move(backend));
    auto model = std::make_shared<Regression>();
    LinearSource data(64);
    trainer.train(model, data);
    out["seen"] = trainer.seen;
    std::ofstream(s.path / ("rank" + std::to_string(rank) + ".json")) << out.dump();
    return 0;
  });
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
  std::vector<json> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back(json::parse(std::ifstream(s.path / ("rank" + std::to_string(r) + ".json"))));
  const GridShape shape = make_grid_shape(4, 2);
  for (int r = 0; r < 4; ++r) {
    const auto& j = ranks[r];
    EXPECT_EQ(j["tp_rank"], r % 2);
    EXPECT_EQ(j["dp_rank"], r / 2);
    EXPECT_EQ(j["tp_group_size"], 2);
    EXPECT_EQ(j["dp_group_size"], 2);
    double tp_want = 0, dp_want = 0;
    for (auto m : tp_group_members(shape, r)) tp_want += static_cast<double>(m);
    for (auto m : dp_group_members(shape, r)) dp_want += static_cast<double>(m);
    EXPECT_EQ(j["tp_sum"].get<double>(), tp_want) << "rank " << r;
    EXPECT_EQ(j["dp_sum"].get<double>(), dp_want) << "rank " << r;
    ASSERT_EQ(j["seen"].size(), 16u) << "4 steps x GA 4 micro-batches on rank " << r;
  }
  // TP peers read the same samples; the two DP members together read each global batch once.
  EXPECT_EQ(ranks[0]["seen"], ranks[1]["seen"]);
  EXPECT_EQ(ranks[2]["seen"], ranks[3]["seen"]);
  std::set<int64_t> all;
  for (int step = 0; step < 4; ++step) {
    std::multiset<int64_t> batch;
    for (int r : {0, 2})
      for (int m = 0; m < 4; ++m)
        for (auto i : ranks[r]["seen"][step * 4 + m]) batch.insert(i.get<int64_t>());
    EXPECT_EQ(batch.size(), 16u) << "step " << step;
    EXPECT_EQ(std::set<int64_t>(batch.begin(), batch.end()).size(), 16u) << "a sample read twice in step " << step;
    all.insert(batch.begin(), batch.end());
  }
  EXPECT_EQ(all.size(), 64u);  // 4 global batches of 16 = the whole (64-sample) epoch
}

// A DDP rank that dies in the middle of the step-2 save (after the folder was prepared and
// rank 0 may have written its files): the job fails, `latest` still names step 1, step 1
// loads, and its marker records the grid and every file's checksum.
class DyingDdp : public DdpBackend {
 public:
  using DdpBackend::DdpBackend;
  int64_t saves = 0;
  bool writes_shard() const override {
    if (context().rank == 1 && ++const_cast<DyingDdp*>(this)->saves == 2) ::kill(::getpid(), SIGKILL);
    return DdpBackend::writes_shard();
  }
};

TEST(ShardedCheckpoint, RankKilledDuringSaveLeavesThePreviousLoadable) {
  if (!comm_engine_available("gloo")) GTEST_SKIP() << "built without Gloo";
  Scratch s;
  const int port = free_port();
  auto status = run_ranks(2, std::chrono::seconds(120), [&](int rank) {
    Config cfg = linear_config(s.path, 8, 4, 2);
    cfg.trainer.env_type = "pytorchDDP";
    cfg.trainer.save_interval = 1;
    cfg.trainer.keep_last = 0;
    cfg.trainer.comm_timeout = 5;
    auto comm = make_gloo_communicator(rank, 2, "127.0.0.1", port, std::chrono::seconds(5));
    LinearTrainer trainer(cfg);
    trainer.set_backend(std::make_unique<DyingDdp>(cfg, std::move(comm)));
    LinearSource data(64);
    trainer.train(std::make_shared<Regression>(), data);
    return 0;
  });
  ASSERT_TRUE(WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL) << status[1];
  EXPECT_FALSE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << "rank 0 finished a save its peer never joined";
  const fs::path ckpt = s.path / "ckpt";
  EXPECT_EQ(latest_checkpoint_tag(ckpt.string()), "global_step1");
  EXPECT_FALSE(fs::exists(ckpt / "global_step2"));
  const CheckpointReader r(ckpt.string(), "global_step1");
  EXPECT_EQ(r.meta()["grid"], (json{{"world", 2}, {"tp", 1}, {"dp", 2}, {"pp", 1}}));
  for (auto f : {"state.pt", "shard_0.pt", "rank_0.pt", "rank_1.pt"}) {
    ASSERT_TRUE(r.has_file(f)) << f;
    EXPECT_TRUE(r.meta()["files"][f].contains("crc32c")) << f;
  }
  // It resumes (at world size 1, from the world-2 shards) and trains on.
  Config one = linear_config(s.path, 8, 8, 1);
  one.trainer.load_dir = ckpt.string();
  one.trainer.save_dir = (s.path / "ckpt1").string();
  one.trainer.max_steps = 2;
  LinearTrainer t1(one);
  LinearSource data(64);
  const auto res = t1.train(std::make_shared<Regression>(), data);
  EXPECT_EQ(res.steps, 2);
  EXPECT_EQ(res.losses.size(), 1u);
  // A folder without its completion marker is refused with a clear error.
  fs::copy(ckpt / "global_step1", ckpt / "global_step9", fs::copy_options::recursive);
  fs::remove(ckpt / "global_step9" / "complete.json");
  std::ofstream(ckpt / "latest") << "global_step9\n";
  LinearTrainer t2(one);
  try {
    t2.train(std::make_shared<Regression>(), data);
    FAIL() << "loaded a checkpoint without its marker";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no completion marker"), std::string::npos) << e.what();
  }
}

// Micro-batches of 8, 8 and 4 samples in one step (as an elastic backend may hand out) make
// the same update as one micro-batch of 20: each micro-batch's mean loss is weighted by its
// samples. The plain mean of the three micro-batch means would not.
class RaggedBackend : public SingleBackend {
 public:
  using SingleBackend::SingleBackend;
  int64_t samples_per_step() const override { return 20; }
  int64_t next_micro_batch(int64_t m, int64_t) const override { return m < 3 ? (m < 2 ? 8 : 4) : 0; }
};

TEST(ElasticAccumulation, MicroBatchesOf8And8And4EqualOneOf20) {
  Scratch s;
  auto run = [&](bool ragged, std::vector<double>* losses) {
    const Config cfg = linear_config(s.path, 20, 20, 1);
    LinearTrainer t(cfg);
    if (ragged) t.set_backend(std::make_unique<RaggedBackend>(cfg));
    torch::manual_seed(3);
    auto model = std::make_shared<Regression>();
    LinearSource data(100);
    *losses = t.train(model, data).losses;
    if (ragged) {
      EXPECT_EQ(t.seen.size(), 12u);  // 4 steps x 3 micro-batches
      EXPECT_EQ(t.seen[2].size(), 4u);
    }
    return model->lin->weight.detach().clone();
  };
  std::vector<double> l20, l884;
  const auto w20 = run(false, &l20), w884 = run(true, &l884);
  ASSERT_EQ(l20.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(l884[i], l20[i], 1e-6 * std::abs(l20[i])) << "step " << i + 1;
  EXPECT_TRUE(torch::allclose(w884, w20, 1e-6, 1e-7)) << w884 << w20;
  // The unweighted mean of micro-batch means differs: the check above can fail.
  LinearSource data(100);
  auto first = SampleStream(100, 1234, 20, 0, 1, false).next(0, 0, 20).indices;
  torch::manual_seed(3);
  Regression fresh;
  auto b = data.make_batch(first, 0);
  auto per = (fresh.lin(b.at("x")) - b.at("y")).pow(2).squeeze(1);
  const double weighted = per.mean().item<double>();
  const double unweighted = (per.narrow(0, 0, 8).mean() + per.narrow(0, 8, 8).mean() + per.narrow(0, 16, 4).mean()).item<double>() / 3;
  EXPECT_NEAR(l884[0], weighted, 1e-5 * weighted);
  EXPECT_GT(std::abs(weighted - unweighted), 1e-3 * weighted);
}

// OneCycle cycles momentum; on an optimizer without beta1 that is a clear error, not a no-op.
TEST(ElasticAccumulation, OneCycleOnSgdIsAnError) {
  Scratch s;
  json doc = config_to_json(linear_config(s.path, 4, 4, 1));
  doc["scheduler"] = {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 0.01}, {"cycle_max_lr", 0.1}}}};
  try {
    config_from_json(doc, "c.json", 1);
    FAIL() << "OneCycle with SGD accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cycle_momentum"), std::string::npos) << e.what();
  }
}

TEST(ElasticAccumulation, EvaluateBeforeTrainWorks) {
  Scratch s;
  LinearTrainer t(linear_config(s.path, 4, 4, 1));
  Regression model;
  LinearSource data(16);
  const auto r = t.evaluate(model, data);
  EXPECT_GT(r.batches, 0);
  EXPECT_TRUE(std::isfinite(r.loss));
}

// The own-stream mode (a decentralized peer): distinct members never share a sample within an
// epoch, and the stream resumes from its cursor.
TEST(SampleStreamTest, OwnStreamsAreDisjointAndResumable) {
  std::set<int64_t> seen;
  for (int64_t member = 0; member < 3; ++member) {
    SampleStream s(30, 7, 1, member, 3, true);
    for (int k = 0; k < 5; ++k)
      for (auto i : s.next(0, 0, 2).indices) EXPECT_TRUE(seen.insert(i).second) << "sample " << i << " read twice";
    SampleStream again(30, 7, 1, member, 3, true);
    again.set_cursor(4);
    SampleStream ref(30, 7, 1, member, 3, true);
    ref.next(0, 0, 4);
    EXPECT_EQ(again.next(0, 0, 3).indices, ref.next(0, 0, 3).indices);
  }
  EXPECT_EQ(seen.size(), 30u);
  // Blocks of the peer's batch: two members reading one block per step read what one process
  // with micro-batches of that size reads, micro-batch by micro-batch.
  SampleStream m0(40, 7, 4, 0, 2, true), m1(40, 7, 4, 1, 2, true);
  for (int64_t step = 0; step < 6; ++step) {  // 40 / 8 = 5 steps per epoch: step 5 is epoch 1
    SampleStream single(40, 7, 8, 0, 1, false);
    EXPECT_EQ(m0.next(0, 0, 4).indices, single.next(step, 0, 4).indices) << step;
    EXPECT_EQ(m1.next(0, 0, 4).indices, single.next(step, 4, 4).indices) << step;
  }
  // Fixed world: the same global batch whatever the number of readers.
  std::set<int64_t> one, two;
  for (auto i : SampleStream(40, 7, 8, 0, 1, false).next(3, 0, 8).indices) one.insert(i);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t m = 0; m < 2; ++m)
      for (auto i : SampleStream(40, 7, 8, r, 2, false).next(3, m * 4, 2).indices) two.insert(i);
  EXPECT_EQ(one, two);
}

}  // namespace

// complete.json edited by hand or written by something else: every field a resume reads is
// checked up front and refused as an InputError naming the file and the key (found while writing
// fuzz/fuzz_checkpoint.cpp: a string format_version or step escaped as a JSON type_error, exit 1).
TEST(CheckpointMarker, MalformedFieldsAreInputErrorsNamingTheKey) {
  const json good = {{"format_version", kCheckpointFormatVersion},
                     {"files", {{"state.pt", {{"size", 10}, {"crc32c", 4294967295u}, {"rank", 0}}}}},
                     {"tag", "global_step1"}, {"step", 1}, {"grid", {{"world", 2}, {"tp", 1}, {"dp", 2}, {"pp", 1}}},
                     {"loss_scaler", nullptr}, {"best_eval_loss", 0.5}};
  EXPECT_NO_THROW(check_checkpoint_marker(good, "c/complete.json"));
  const std::vector<std::pair<json, std::string>> bad = {
      {json::array(), "not a JSON object"},
      {json{{"files", json::object()}}, "'format_version'"},
      {json{{"format_version", "2"}, {"files", json::object()}}, "'format_version'"},
      {json{{"format_version", 1}, {"files", json::object()}}, "format_version 1"},
      {json{{"format_version", kCheckpointFormatVersion}}, "'files'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", {{"state.pt", 3}}}}, "'files.state.pt'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", {{"state.pt", {{"size", -1}, {"crc32c", 0}}}}}}, "'files.state.pt.size'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", {{"state.pt", {{"size", 1}, {"crc32c", 4294967296u}}}}}},
       "'files.state.pt.crc32c'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", {{"../x", {{"size", 1}, {"crc32c", 1}}}}}}, "not a plain file name"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"step", "3"}}, "'step'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"step", 2.5}}, "'step'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"world_size", -2}}, "'world_size'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"grid", {{"tp", 1}}}}, "no 'world'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"grid", {{"world", 0}}}}, "'grid.world'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"loss_scaler", 1}}, "'loss_scaler'"},
      {json{{"format_version", kCheckpointFormatVersion}, {"files", json::object()}, {"best_eval_loss", "low"}}, "'best_eval_loss'"},
  };
  for (const auto& [meta, expected] : bad) {
    try {
      check_checkpoint_marker(meta, "c/complete.json");
      ADD_FAILURE() << "accepted " << meta.dump();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("c/complete.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what() << " (expected " << expected << ")";
    }
  }
  // Through the reader, as a resume meets it; and a `latest` naming '..' is refused.
  Scratch s;
  const fs::path dir = s.path / "ckpt";
  fs::create_directories(dir / "t");
  std::ofstream(dir / "t" / "complete.json") << R"({"format_version": "2", "files": {}})";
  EXPECT_THROW(CheckpointReader(dir.string(), "t"), InputError);
  std::ofstream(dir / "latest") << "..\n";
  EXPECT_THROW(latest_checkpoint_tag(dir.string()), InputError);
}

// Checkpoint files hold archives encoded by archive_codec (safetensors + the key tree): every
// kind of value a writer uses comes back as written, through a rebuilt libtorch archive.
TEST(ArchiveCodec, RoundTripsEveryKindOfValue) {
  torch::serialize::OutputArchive a, sub, subsub;
  const auto w = torch::randn({3, 4});
  a.write("w", w);                                                   // a parameter-style tensor
  a.write("ids", c10::IValue(torch::arange(5, torch::kLong)));       // an attribute tensor
  a.write("rng", torch::tensor({1, 2, 255}, torch::kByte));
  a.write("step", c10::IValue(int64_t{-7}));
  a.write("lr", c10::IValue(std::nan("")));
  a.write("flag", c10::IValue(true));
  a.write("pieces", c10::IValue(std::string("{\"a\": 1}")));
  a.write("names", c10::IValue(c10::List<std::string>({"x.weight", "y.bias"})));
  subsub.write("half", torch::ones({2}, torch::kHalf));
  sub.write("deep", subsub);
  sub.write("empty", torch::empty({0, 3}));
  a.write("s0", sub);
  const std::string bytes = encode_archive(a);
  ASSERT_EQ(bytes.compare(8, 1, "{"), 0) << "not safetensors";

  torch::serialize::InputArchive in;
  decode_archive(bytes, "mem", in);
  auto tensor = [](torch::serialize::InputArchive& a, const std::string& key) {
    at::Tensor t;  // a fresh one each time: read() into a defined tensor resizes it in place
    a.read(key, t);
    return t;
  };
  auto value = [](torch::serialize::InputArchive& a, const std::string& key) {
    c10::IValue v;
    a.read(key, v);
    return v;
  };
  EXPECT_TRUE(torch::equal(tensor(in, "w"), w));
  EXPECT_TRUE(torch::equal(value(in, "ids").toTensor(), torch::arange(5, torch::kLong)));
  const at::Tensor rng = tensor(in, "rng");
  EXPECT_EQ(rng.scalar_type(), torch::kByte);
  EXPECT_EQ(rng[2].item<int>(), 255);
  EXPECT_EQ(value(in, "step").toInt(), -7);
  EXPECT_TRUE(std::isnan(value(in, "lr").toDouble()));
  EXPECT_TRUE(value(in, "flag").toBool());
  EXPECT_EQ(value(in, "pieces").toStringRef(), "{\"a\": 1}");
  const auto names = value(in, "names");
  ASSERT_EQ(names.toListRef().size(), 2u);
  EXPECT_EQ(names.toListRef()[1].toStringRef(), "y.bias");
  torch::serialize::InputArchive s0, deep;
  in.read("s0", s0);
  s0.read("deep", deep);
  EXPECT_EQ(tensor(deep, "half").scalar_type(), torch::kHalf);
  EXPECT_EQ(tensor(s0, "empty").sizes(), (std::vector<int64_t>{0, 3}));
  // Named tensors as the trainer saves them come back through the codec.
  torch::serialize::OutputArchive again;
  save_named_tensors({{"w", w}}, again);
  torch::serialize::InputArchive named;
  decode_archive(encode_archive(again), "mem", named);
  EXPECT_TRUE(torch::equal(load_named_tensors_archive(named).at(0).second, w));
}

// What a hand edit or a hostile peer can put in place of an archive: each is an InputError
// naming its origin; libtorch's archive reader never sees the bytes.
TEST(ArchiveCodec, MalformedTreesAreInputErrors) {
  auto encode = [](const json& tree, const NamedTensors& tensors) {
    return safetensors_bytes(tensors, {{kArchiveTreeKey, tree.dump()}});
  };
  const NamedTensors one = {{"0", torch::ones({2})}};
  const std::vector<std::tuple<std::string, std::string, std::string>> bad = {
      {"not safetensors", "PK\x03\x04 a zip archive", "invalid safetensors"},
      {"no tree", safetensors_bytes(one), "not a polytrain archive"},
      {"tree not JSON", safetensors_bytes(one, {{kArchiveTreeKey, "{"}}), "not a JSON object"},
      {"version", encode({{"version", 9}, {"root", json::array()}}, {}), "version 9"},
      {"no root", encode({{"version", 1}}, {}), "no 'root'"},
      {"entry shape", encode({{"version", 1}, {"root", json::array({json::array({"a", "int"})})}}, {}),
       "not [key, kind, value]"},
      {"key", encode({{"version", 1}, {"root", {{"a.b", "int", 1}}}}, {}), "not an identifier"},
      {"training", encode({{"version", 1}, {"root", {{"training", "bool", true}}}}, {}), "not an identifier"},
      {"twice", encode({{"version", 1}, {"root", {{"a", "int", 1}, {"a", "int", 2}}}}, {}), "appears twice"},
      {"kind", encode({{"version", 1}, {"root", {{"a", "code", "import os"}}}}, {}), "unknown kind 'code'"},
      {"missing tensor", encode({{"version", 1}, {"root", {{"a", "tensor", "7"}}}}, one), "not in the data"},
      {"tensor twice", encode({{"version", 1}, {"root", {{"a", "tensor", "0"}, {"b", "tensor", "0"}}}}, one),
       "named by two"},
      {"unnamed tensor", encode({{"version", 1}, {"root", json::array()}}, one), "no archive entry names"},
      {"device", encode({{"version", 1}, {"root", {{"a", "tensor", "0", "meta"}}}}, one), "not cuda[:N]"},
      {"int", encode({{"version", 1}, {"root", {{"a", "int", 1.5}}}}, {}), "not a 64-bit integer"},
      {"int range", encode({{"version", 1}, {"root", {{"a", "int", uint64_t{1} << 63}}}}, {}), "not a 64-bit integer"},
      {"double", encode({{"version", 1}, {"root", {{"a", "double", "0"}}}}, one), "not a 0-d F64"},
      {"strings", encode({{"version", 1}, {"root", {{"a", "strings", {"x", 2}}}}}, {}), "not a list of strings"},
      {"nested", encode({{"version", 1}, {"root", {{"a", "archive", 3}}}}, {}), "is not a list of entries"},
  };
  for (const auto& [what, bytes, expected] : bad) {
    EXPECT_THROW(check_archive(bytes, "peer 1.2.3.4"), InputError) << what;
    torch::serialize::InputArchive in;
    try {
      decode_archive(bytes, "peer 1.2.3.4", in);
      ADD_FAILURE() << what << ": accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("peer 1.2.3.4"), std::string::npos) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << what << ": " << e.what();
    }
  }
  // Nesting deeper than 16 is refused before any recursion runs out of stack.
  json deep = json::array();
  for (int i = 0; i < 40; ++i) deep = json::array({json::array({"a", "archive", deep})});
  torch::serialize::InputArchive in;
  EXPECT_THROW(decode_archive(encode({{"version", 1}, {"root", deep}}, {}), "x", in), InputError);
}

// fuzz/known_crashes/fuzz_checkpoint-libtorch-jit-load-segv: a state.pt edited by hand with a
// matching CRC-32C used to reach libtorch 1.13's TorchScript reader, which crashed (SEGV in
// ScriptTypeParser). Format 3 never hands a file's bytes to it: a TorchScript archive, intact
// or edited at any byte, is an InputError naming the file.
TEST(CheckpointMarker, HandEditedArchiveIsAnInputErrorNotACrash) {
  torch::serialize::OutputArchive a, m;
  save_named_tensors({{"w", torch::arange(6, torch::kFloat).view({2, 3})}, {"b", torch::ones({3}, torch::kLong)}}, m);
  a.write("model", m);
  std::ostringstream os;
  a.save_to(os);
  const std::string torchscript = os.str();
  Scratch s;
  const fs::path dir = s.path / "ckpt";
  std::mt19937 rng(14);
  for (int trial = 0; trial < 64; ++trial) {
    std::string state = torchscript;
    for (int e = trial == 0 ? 0 : 1 + static_cast<int>(rng() % 8); e > 0; --e)
      state[rng() % state.size()] = static_cast<char>(rng());
    fs::remove_all(dir);
    fs::create_directories(dir / "t");
    std::ofstream(dir / "t" / "state.pt", std::ios::binary) << state;
    const json marker = {{"format_version", kCheckpointFormatVersion},
                         {"files", {{"state.pt", {{"size", state.size()}, {"crc32c", crc32c(state.data(), state.size())}}}}}};
    std::ofstream(dir / "t" / "complete.json") << marker.dump();
    const CheckpointReader ck(dir.string(), "t");
    try {
      ck.read_archive("state.pt", [](torch::serialize::InputArchive&) { FAIL() << "decoded a TorchScript archive"; });
      ADD_FAILURE() << "trial " << trial << ": accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("state.pt"), std::string::npos) << e.what();
    }
  }
}
