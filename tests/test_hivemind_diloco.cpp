// Local updates (hivemind.outer_optimizer, DiLoCo): the outer step's math on known vectors
// (torch.optim.SGD's, with and without Nesterov), the key's errors, and train_bert swarms on the
// corpus: two peers with 4 inner steps per global step end each outer step with the same bits,
// average their pseudo-gradients every global step and send a fraction of the bytes per sample of
// per-step averaging; a late joiner loads the outer parameters and momentum from the donors and
// ends with the founders' bits; client-mode and auxiliary peers take part; a checkpoint resumes
// with the outer momentum; what cannot go with local updates is a one-line error.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "helpers/free_port.h"
#include "helpers/own_process.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/shipped_config.h"
#include "helpers/swarm_helpers.h"
#include "helpers/temp_dir.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/error.h"
#include "polytrain/parallel/hivemind/outer_optimizer.h"
#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/compression.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using polytrain::hivemind::OuterOptimizer;
using polytrain::hivemind::OuterOptimizerOptions;
using polytrain::hivemind::parse_outer_optimizer;
using polytrain::testing::OwnProcess;

namespace {

at::Tensor vec(std::vector<float> v) { return torch::tensor(v, torch::kFloat); }

// The outer parameters after a step from `outer` with the pseudo-gradient `local` gives.
at::Tensor after_step(OuterOptimizer& o, const at::Tensor& local) {
  at::Tensor delta = torch::empty({o.numel()}, torch::kFloat);
  o.pseudo_gradient({local}, delta);
  o.step(delta);
  at::Tensor out = torch::empty_like(local);
  o.copy_to({out});
  return out;
}

void expect_values(const at::Tensor& t, std::vector<double> want, const char* what) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(t[i].item<double>(), want[i], 1e-5) << what << " [" << i << "]";
}

}  // namespace

// DiLoCo's outer step is torch.optim.SGD(lr 0.7, momentum 0.9, nesterov=True) on delta = outer -
// local. From outer (1, 2, 3, -1), local (0.5, 2.5, 3, -2): delta (0.5, -0.5, 0, 1), buf = delta,
// d = 1.9 delta, outer -= 1.33 delta = (0.335, 2.665, 3, -2.33). Then local (-0.665, 2.665, 4,
// -2.83): delta (1, 0, -1, 0.5), buf = 0.9 buf + delta = (1.45, -0.45, -1, 1.4), d = delta + 0.9 buf
// = (2.305, -0.405, -1.9, 1.76), outer -= 0.7 d = (-1.2785, 2.9485, 4.33, -3.562).
TEST(OuterOptimizer, NesterovStepsAsTorchSgdWithNesterov) {
  OuterOptimizer o(*parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "nesterov",
      "params": {"lr": 0.7, "momentum": 0.9}}})")));
  o.reset({vec({1, 2, 3, -1})});
  expect_values(after_step(o, vec({0.5, 2.5, 3, -2})), {0.335, 2.665, 3, -2.33}, "step 1");
  expect_values(o.momentum(), {0.5, -0.5, 0, 1}, "momentum 1");
  expect_values(after_step(o, vec({-0.665, 2.665, 4, -2.83})), {-1.2785, 2.9485, 4.33, -3.562}, "step 2");
  expect_values(o.momentum(), {1.45, -0.45, -1, 1.4}, "momentum 2");
}

// Plain SGD with lr 1 and no momentum lands on the averaged local parameters (FedAvg); with a
// momentum and no Nesterov the step is lr x buf.
TEST(OuterOptimizer, SgdLandsOnTheAverageAndItsMomentumIsHeavyBall) {
  OuterOptimizer avg(*parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "sgd"}})")));
  avg.reset({vec({1, 2, 3})});
  // Two peers' local parameters (2, 2, 0) and (0, 4, 1): their averaged pseudo-gradient.
  at::Tensor d0 = torch::empty({3}), d1 = torch::empty({3});
  avg.pseudo_gradient({vec({2, 2, 0})}, d0);
  avg.pseudo_gradient({vec({0, 4, 1})}, d1);
  avg.step((d0 + d1) / 2);
  at::Tensor out = torch::empty({3});
  avg.copy_to({out});
  expect_values(out, {1, 3, 0.5}, "sgd lr 1");

  OuterOptimizer heavy(*parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "sgd",
      "params": {"lr": 0.5, "momentum": 0.5}}})")));
  heavy.reset({vec({0, 0})});
  expect_values(after_step(heavy, vec({-1, 2})), {-0.5, 1}, "heavy ball step 1: outer -= 0.5 x (1, -2)");
  // delta = (1, -2) again: buf = 0.5 buf + delta = (1.5, -3).
  expect_values(after_step(heavy, vec({-1.5, 3})), {-1.25, 2.5}, "heavy ball step 2: outer -= 0.5 x (1.5, -3)");
}

// The outer state is fp32 whatever the model's dtype: a bf16 parameter's pseudo-gradient is taken
// against the fp32 outer copy, and the outer values are rounded only on their way into the model.
TEST(OuterOptimizer, OuterParametersStayFp32BesideABf16Model) {
  OuterOptimizer o(*parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "sgd",
      "params": {"lr": 0.5}}})")));
  const at::Tensor p = vec({1.0f, 1000.0f}).to(torch::kBFloat16).reshape({1, 2});
  o.reset({p});
  at::Tensor delta = torch::empty({2});
  o.pseudo_gradient({vec({0.0f, 1000.0f}).to(torch::kBFloat16).reshape({1, 2})}, delta);
  o.step(delta);
  EXPECT_EQ(o.views({p})[0].scalar_type(), torch::kFloat);
  expect_values(o.views({p})[0].reshape({-1}), {0.5, 1000}, "outer");
  o.copy_to({p});
  EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  expect_values(p.to(torch::kFloat).reshape({-1}), {0.5, 1000}, "model");
}

TEST(OuterOptimizer, TheKeyIsCheckedWithOneLineNamingIt) {
  EXPECT_FALSE(parse_outer_optimizer(json::parse(R"({"compression": "uint8"})")));
  EXPECT_FALSE(parse_outer_optimizer(json::parse(R"({"outer_optimizer": null})")));
  const auto d = *parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "nesterov"}})"));
  EXPECT_EQ(d.lr, 0.7);
  EXPECT_EQ(d.momentum, 0.9);
  EXPECT_TRUE(d.nesterov);
  const auto s = *parse_outer_optimizer(json::parse(R"({"outer_optimizer": {"type": "sgd"}})"));
  EXPECT_EQ(s.lr, 1.0);
  EXPECT_EQ(s.momentum, 0.0);
  EXPECT_FALSE(s.nesterov);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("nesterov")", "hivemind.outer_optimizer: must be an object"},
      {R"({"type": "adam"})", "hivemind.outer_optimizer.type: must be \"nesterov\" or \"sgd\", got \"adam\""},
      {R"({"params": {}})", "hivemind.outer_optimizer.type"},
      {R"({"type": "sgd", "lr": 1})", "hivemind.outer_optimizer: unknown key 'lr'"},
      {R"({"type": "nesterov", "params": {"lr": 0.7, "betas": 1}})", "unknown key 'betas'"},
      {R"({"type": "nesterov", "params": {"momentum": 1.0}})", "momentum: must be in [0, 1), got 1"},
      {R"({"type": "nesterov", "params": {"momentum": 0}})", "Nesterov needs a momentum > 0"},
      {R"({"type": "sgd", "params": {"lr": 0}})", "lr: must be a finite number > 0"},
      {R"({"type": "sgd", "params": {"lr": "1"}})", "lr: must be a number"},
  };
  for (const auto& [value, message] : bad) {
    try {
      parse_outer_optimizer(json::parse("{\"outer_optimizer\": " + value + "}"));
      ADD_FAILURE() << value << ": accepted";
    } catch (const polytrain::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << value << ": " << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
}

// The pseudo-gradient round's AllReduceOptions::same_result: under uint8 and int4 three members
// end with the same bits (the reducers' own parts too), within the codec's error of the weighted
// mean; hivemind's difference-to-what-was-sent results, without it, leave them apart.
TEST(SameResult, CompressedRoundsLeaveEveryMemberWithTheSameBits) {
  namespace hm = polytrain::hivemind;
  const size_t n = 100'000;
  for (auto c : {hm::Compression::kUint8, hm::Compression::kInt4})
    for (bool same : {true, false}) {
      std::vector<std::unique_ptr<hm::AveragingPeer>> peers;
      for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<hm::AveragingPeer>());
      const auto g = polytrain::testing::group_of(peers, std::string("same-") + hm::compression_name(c) + (same ? "1" : "0"));
      std::vector<std::vector<float>> v(3, std::vector<float>(n));
      std::mt19937_64 rng(7);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (auto& x : v)
        for (float& e : x) e = d(rng);
      auto vv = v;
      const double w[3] = {8, 16, 24};
      hm::AllReduceOptions o;
      o.compression = c;
      o.chunk_elements = 10'000;  // several chunks per part
      o.same_result = same;
      std::vector<std::thread> t;
      for (size_t i = 0; i < 3; ++i)
        t.emplace_back([&, i] {
          auto gi = g;
          gi.self = i;
          const auto r = peers[i]->averager.allreduce(gi, vv[i].data(), n, w[i], o);
          EXPECT_EQ(r.warning(), "");
        });
      for (auto& th : t) th.join();
      double worst = 0;
      size_t differ = 0;
      for (size_t k = 0; k < n; ++k) {
        const double avg = (w[0] * v[0][k] + w[1] * v[1][k] + w[2] * v[2][k]) / 48.0;
        for (int i = 0; i < 3; ++i) worst = std::max(worst, std::fabs(vv[i][k] - avg));
        differ += vv[0][k] != vv[1][k] || vv[0][k] != vv[2][k];
      }
      std::printf("[same_result] %s same_result=%d: worst %.4f from the mean, %zu of %zu values differ between members\n",
                  hm::compression_name(c), same, worst, differ, n);
      EXPECT_LE(worst, c == hm::Compression::kInt4 ? 1.0 : 0.06) << hm::compression_name(c);
      if (same) EXPECT_EQ(differ, 0u) << hm::compression_name(c);
      else EXPECT_GT(differ, n / 2) << hm::compression_name(c) << ": the members were expected to differ";
    }
}

namespace {

using polytrain::testing::bert_vocab_present;

const std::string kTrainBert = POLYTRAIN_BINARY_DIR "/train_bert";


// Peers of train_bert on the corpus, bert_tiny without dropout and with a constant lr (the
// warmup's lr 0 at step 0 would leave a first global step of inner steps without effect).
struct LocalUpdates : ::testing::Test {
  polytrain::testing::TempDir tmp{"pt_diloco"};
  fs::path dir = tmp.path;
  void SetUp() override {
    PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
    json c = polytrain::testing::deterministic_bert_tiny(dir / "exp", 1);
    c.erase("scheduler");
    c["hivemind"]["compression"] = "uint8";
    c["hivemind"]["average_state_every"] = 0;  // gradient rounds only: the cheapest per-step averaging
    std::ofstream(dir / "per_step.json") << c.dump(2);
    c["hivemind"]["outer_optimizer"] = {{"type", "nesterov"}, {"params", {{"lr", 0.7}, {"momentum", 0.9}}}};
    std::ofstream(dir / "local.json") << c.dump(2);
  }

  // Peer `k` of a swarm whose first peer listens on `first`: micro-batches of 8 samples, stream k of 3.
  std::unique_ptr<OwnProcess> peer(const std::string& name, const std::string& config, const std::string& first, int k,
                                   const std::string& extra) {
    const std::string cmd = "OMP_NUM_THREADS=1 exec " + kTrainBert + " --config '" + (dir / config).string() +
                            "' --experiment_name " + name + " --save_dir '" + (dir / name).string() +
                            "' --env_type hivemind --train_batch_size 8 --train_micro_batch_size_per_gpu 8"
                            " --num_streams 3 --stream_index " + std::to_string(k) + " --listen " +
                            (k == 0 ? first : "127.0.0.1:0 --initial_peers " + first) + " " + extra;
    return std::make_unique<OwnProcess>(cmd, POLYTRAIN_SOURCE_DIR, (dir / (name + ".log")).string());
  }

  // Each of `peers` ends by itself within `seconds` (else all are killed) with exit code 0.
  bool all_finish(std::vector<std::unique_ptr<OwnProcess>>& peers, int seconds) {
    const bool done = polytrain::testing::wait_until(
        [&] {
          for (auto& p : peers)
            if (p->running()) return false;
          return true;
        },
        seconds);
    for (auto& p : peers) {
      if (!done) p->signal(SIGKILL);
      EXPECT_EQ(p->wait(), 0) << p->output();
    }
    return done;
  }

  // Two peers (tag0, tag1) for `steps` global steps of `target` samples, saving at the last.
  void run_pair(const std::string& tag, const std::string& config, int steps, int target) {
    const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
    const std::string extra = "--max_steps " + std::to_string(steps) + " --save_interval " + std::to_string(steps) +
                              " --target_batch_size " + std::to_string(target) + " --expected_peers 2 --run_id " + tag +
                              "-" + std::to_string(::getpid()) + " --matchmaking_time 10 --averaging_timeout 30";
    std::vector<std::unique_ptr<OwnProcess>> peers;
    for (int k = 0; k < 2; ++k) peers.push_back(peer(tag + std::to_string(k), config, first, k, extra));
    ASSERT_TRUE(all_finish(peers, 240)) << tag << ": the peers did not finish in 240 s";
  }

  std::string log(const std::string& name) const {
    std::ifstream in(dir / (name + ".log"));
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }

  // `key` of every step record of run `name`'s metrics.jsonl.
  std::vector<double> metric(const std::string& name, const std::string& key) {
    std::vector<double> out;
    for (const auto& run : fs::directory_iterator(dir / "exp")) {
      const fs::path m = run.path() / name / "metrics.jsonl";
      if (!fs::exists(m)) continue;
      std::ifstream in(m);
      for (std::string l; std::getline(in, l);) {
        const json j = json::parse(l);
        if (j.contains(key) && j.contains("step")) out.push_back(j[key].get<double>());
      }
    }
    return out;
  }

  std::map<std::string, at::Tensor> weights(const std::string& name, int64_t step) {
    return polytrain::testing::saved_weights(dir, name, step);
  }
};

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    EXPECT_TRUE(b.count(k)) << k;
    if (b.count(k)) worst = std::max(worst, (b.at(k) - v).abs().max().item<double>());
  }
  return worst;
}

size_t count(const std::string& text, const std::string& pattern) {
  const std::regex re(pattern);
  return static_cast<size_t>(std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

double total(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

// The local samples of each outer step in a peer's log ("outer step K: N inner steps on M local
// samples"), in order.
std::vector<int> outer_samples(const std::string& out) {
  std::vector<int> v;
  const std::regex re("hivemind: outer step [0-9]+: [0-9]+ inner steps on ([0-9]+) local samples");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    v.push_back(std::stoi((*it)[1]));
  return v;
}

// Both peers made two outer steps of 64 samples swarm-wide. The target batch is the swarm's, not
// a peer's: a peer that runs faster (ctest -j2 beside another job) takes more of it (5 and 3
// inner steps instead of 4 and 4, seen once), so only the sums are fixed.
void expect_two_outer_steps_of_64(const std::string& out0, const std::string& out1) {
  const auto a = outer_samples(out0), b = outer_samples(out1);
  ASSERT_EQ(a.size(), 2u) << out0;
  ASSERT_EQ(b.size(), 2u) << out1;
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(a[i] + b[i], 64) << "outer step " << i + 1 << "\n" << out0 << out1;
}

}  // namespace

// The same 128 samples swarm-wide, from the same streams: per-step averaging takes 8 global steps
// of 16 (one micro-batch of 8 per peer, a uint8 gradient round each), local updates 2 global steps
// of 64 (4 inner steps per peer, one uint8 pseudo-gradient round each). Each
// outer step ends with both peers holding the same bits (the outer parameters), different from
// the per-step run's; the local-update peers send under a third of the bytes per sample.
TEST_F(LocalUpdates, PeersStepLocallyAverageThePseudoGradientsAndEndIdentical) {
  run_pair("step", "per_step.json", 8, 16);
  run_pair("local", "local.json", 2, 64);
  for (int k = 0; k < 2; ++k) {
    const std::string out = log("local" + std::to_string(k));
    EXPECT_NE(out.find("hivemind: local updates (DiLoCo): every micro-batch is a step of this peer's AdamW"),
              std::string::npos) << out;
    EXPECT_EQ(count(out, "hivemind: Averaged tensors successfully with 2 peers"), 2u) << out;
    EXPECT_EQ(out.find("no averaging group"), std::string::npos) << out;
    EXPECT_EQ(count(log("step" + std::to_string(k)), "hivemind: Averaged tensors successfully with 2 peers"), 8u);
  }
  expect_two_outer_steps_of_64(log("local0"), log("local1"));
  EXPECT_EQ(max_difference(weights("local0", 2), weights("local1", 2)), 0.0) << "the peers differ after the outer step";
  EXPECT_GT(max_difference(weights("local0", 2), weights("step0", 8)), 1e-4) << "local updates changed nothing";

  const double step_bytes = total(metric("step0", "sent_bytes")) + total(metric("step0", "received_bytes"));
  const double local_bytes = total(metric("local0", "sent_bytes")) + total(metric("local0", "received_bytes"));
  const auto step_mine = metric("step0", "contributed_samples"), local_mine = metric("local0", "contributed_samples");
  ASSERT_FALSE(step_mine.empty());
  ASSERT_FALSE(local_mine.empty());
  const double step_samples = step_mine.back(), local_samples = local_mine.back();
  ASSERT_EQ(step_samples + metric("step1", "contributed_samples").back(), 128.0);
  ASSERT_EQ(local_samples + metric("local1", "contributed_samples").back(), 128.0);
  std::printf("[diloco] bytes per sample (sent + received, peer 0): per-step %.0f, local updates (H = 4) %.0f: %.2fx less\n",
              step_bytes / step_samples, local_bytes / local_samples, step_bytes / local_bytes);
  EXPECT_GT(local_bytes, 0.0) << "the pseudo-gradient rounds are not counted";
  EXPECT_LT(local_bytes * 3, step_bytes);
  const auto loss_local = metric("local0", "loss");
  ASSERT_EQ(loss_local.size(), 2u);
  EXPECT_TRUE(std::isfinite(loss_local[1]));
}

// Local updates beside the other options of a round: CenteredClip aggregation of the
// pseudo-gradients, bf16 autocast (fp32 weights and outer state) and the optimizer offloaded
// to the background thread. Both peers make both outer steps and end with the same bits.
TEST_F(LocalUpdates, CenteredClipBf16AndOffloadGoWithIt) {
  std::ifstream in(dir / "local.json");
  json c = json::parse(in);
  c["hivemind"]["aggregation"] = "centered_clip";
  c["hivemind"]["offload_optimizer"] = true;
  c["bf16"] = {{"enabled", true}};
  std::ofstream(dir / "mix.json") << c.dump(2);
  run_pair("mix", "mix.json", 2, 64);
  for (int k = 0; k < 2; ++k) {
    const std::string out = log("mix" + std::to_string(k));
    EXPECT_EQ(count(out, "hivemind: Averaged tensors successfully with 2 peers"), 2u) << out;
    EXPECT_NE(out.find("hivemind: offload_optimizer: the optimizer steps an fp32 copy"), std::string::npos) << out;
    EXPECT_EQ(out.find("bf16: training in fp32 instead"), std::string::npos) << out;
  }
  expect_two_outer_steps_of_64(log("mix0"), log("mix1"));
  EXPECT_EQ(max_difference(weights("mix0", 2), weights("mix1", 2)), 0.0) << "the peers differ after the outer steps";
  const auto loss = metric("mix0", "loss");
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_TRUE(std::isfinite(loss[0]) && std::isfinite(loss[1]));
}

namespace {

// The outer momentum a checkpoint's shard holds (hivemind_outer_momentum).
at::Tensor outer_momentum(const fs::path& save_dir, int64_t step) {
  const polytrain::CheckpointReader ck(save_dir.string(), "global_step" + std::to_string(step));
  at::Tensor m;
  polytrain::ShardReader(ck).read_shard(0, [&](torch::serialize::InputArchive& a, const std::string&) {
    a.try_read(polytrain::hivemind::kOuterMomentumKey, m);
  });
  return m;
}

}  // namespace

// Checkpoints keep the outer momentum: both peers saved the same bits at step 2, and a peer
// resumed from it alone (its outer step on its own pseudo-gradient delta) ends step 3 with
// momentum 0.9 m2 + delta, whose difference to 0.9 m2 has the norm its log line gives for delta
// (with a momentum restarted at zero that difference would be off by 0.9 |m2|).
TEST_F(LocalUpdates, ACheckpointKeepsTheOuterMomentumAndAResumeContinuesIt) {
  run_pair("ck", "local.json", 2, 64);
  const at::Tensor m2 = outer_momentum(dir / "ck0", 2);
  ASSERT_TRUE(m2.defined()) << "no outer momentum in the checkpoint";
  ASSERT_TRUE(m2.equal(outer_momentum(dir / "ck1", 2))) << "the peers' outer momenta differ";
  ASSERT_GT(m2.norm().item<double>(), 0.0);
  const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  std::vector<std::unique_ptr<OwnProcess>> one;
  one.push_back(peer("resumed", "local.json", first, 0,
                     "--load_dir '" + (dir / "ck0").string() + "' --max_steps 3 --save_interval 3 "
                     "--target_batch_size 64 --run_id ck-resumed-" + std::to_string(::getpid()) +
                     " --matchmaking_time 1 --request_timeout 0.5 --averaging_timeout 3"));
  ASSERT_TRUE(all_finish(one, 120));
  const std::string out = log("resumed");
  EXPECT_EQ(out.find("no outer momentum"), std::string::npos) << out;
  const std::smatch m = [&] {
    std::smatch r;
    std::regex_search(out, r, std::regex("hivemind: outer step 3: 8 inner steps on 64 local samples, pseudo-gradient norm ([0-9.e+-]+)"));
    return r;
  }();
  ASSERT_EQ(m.size(), 2u) << out;
  const double delta_norm = std::stod(m[1]);
  const at::Tensor m3 = outer_momentum(dir / "resumed", 3);
  ASSERT_TRUE(m3.defined());
  const double got = (m3 - 0.9 * m2).norm().item<double>();
  std::printf("[diloco] resumed: |m3 - 0.9 m2| %.6g, |delta| from the log %.6g, |m2| %.6g\n", got, delta_norm,
              m2.norm().item<double>());
  EXPECT_NEAR(got, delta_norm, 1e-4 * delta_norm);
}

// A peer that joins two founders late loads the outer parameters and the outer momentum from the
// donors (the state all of them serve is the same bytes) and, from its first round on, ends
// every outer step with their bits.
TEST_F(LocalUpdates, ALateJoinerLoadsTheOuterStateAndEndsWithTheFoundersBits) {
  constexpr int kSteps = 12;
  const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  const std::string common = "--max_steps " + std::to_string(kSteps) + " --save_interval " + std::to_string(kSteps) +
                             " --target_batch_size 48 --run_id late-" + std::to_string(::getpid()) +
                             " --matchmaking_time 10 --averaging_timeout 30";
  std::vector<std::unique_ptr<OwnProcess>> peers;
  for (int k = 0; k < 2; ++k) peers.push_back(peer("founder" + std::to_string(k), "local.json", first, k, common + " --expected_peers 2"));
  ASSERT_TRUE(polytrain::testing::eventually([&] { return log("founder0").find("hivemind: outer step 2:") != std::string::npos; },
                                             std::chrono::seconds(60)))
      << log("founder0");
  peers.push_back(peer("late", "local.json", first, 2, common));
  ASSERT_TRUE(all_finish(peers, 240));
  const std::string late = log("late");
  EXPECT_NE(late.find("loaded the swarm's state at epoch"), std::string::npos) << late;
  EXPECT_GE(count(late, "hivemind: Averaged tensors successfully with 3 peers"), 1u) << late;
  EXPECT_EQ(max_difference(weights("founder0", kSteps), weights("founder1", kSteps)), 0.0);
  EXPECT_EQ(max_difference(weights("founder0", kSteps), weights("late", kSteps)), 0.0) << late;
  EXPECT_TRUE(outer_momentum(dir / "founder0", kSteps).equal(outer_momentum(dir / "late", kSteps)));
}

// What local updates cannot go with, and a bad or misspelled key, stop train_bert with exit code 2
// and one line naming the key.
TEST_F(LocalUpdates, WhatCannotGoWithItIsAOneLineError) {
  using polytrain::testing::expect_one_line_error;
  using polytrain::testing::run_program;
  auto variant = [&](const std::string& name, const std::function<void(json&)>& edit) {
    std::ifstream in(dir / "local.json");
    json c = json::parse(in);
    edit(c);
    std::ofstream(dir / name) << c.dump(2);
    return kTrainBert + " --config '" + (dir / name).string() + "' --save_dir '" + (dir / "bad").string() +
           "' --env_type hivemind --train_batch_size 8 --train_micro_batch_size_per_gpu 8 --target_batch_size 64";
  };
  expect_one_line_error(run_program(variant("adam.json", [](json& c) { c["hivemind"]["outer_optimizer"]["type"] = "adam"; })),
                        "hivemind.outer_optimizer.type: must be \"nesterov\" or \"sgd\", got \"adam\"");
  expect_one_line_error(run_program(variant("typo.json",
                                            [](json& c) {
                                              c["hivemind"]["outer_optimiser"] = c["hivemind"]["outer_optimizer"];
                                              c["hivemind"].erase("outer_optimizer");
                                            })),
                        "did you mean 'outer_optimizer'?");
  const std::string local = variant("plain.json", [](json&) {});
  expect_one_line_error(run_program(local + " --average_opt_statistics exp_avg"),
                        "hivemind.outer_optimizer: cannot be combined with hivemind.average_opt_statistics");
  expect_one_line_error(run_program(local + " --fp16"), "hivemind.outer_optimizer: fp16 (dynamic loss scaling)");
  expect_one_line_error(run_program(variant("offload.json", [](json& c) { c["hivemind"]["offload_optimizer"] = true; }) +
                                    " --delay_optimizer_step"),
                        "hivemind.outer_optimizer: cannot be combined with hivemind.delay_optimizer_step");
}

// A client-mode peer (no inbound connections: it reduces nothing) beside two trainers takes part
// in the pseudo-gradient rounds and ends with the trainers' bits.
TEST_F(LocalUpdates, AClientModePeerTakesPartInTheRoundsAndEndsIdentical) {
  constexpr int kSteps = 4;
  const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  const std::string common = "--max_steps " + std::to_string(kSteps) + " --save_interval " + std::to_string(kSteps) +
                             " --target_batch_size 96 --expected_peers 2 --run_id client-" + std::to_string(::getpid()) +
                             " --matchmaking_time 10 --averaging_timeout 30";
  std::vector<std::unique_ptr<OwnProcess>> peers;
  for (int k = 0; k < 3; ++k)
    peers.push_back(peer(k == 2 ? "client" : "trainer" + std::to_string(k), "local.json", first, k,
                         common + (k == 2 ? " --client_mode" : "")));
  ASSERT_TRUE(all_finish(peers, 240));
  const std::string client = log("client");
  EXPECT_NE(client.find("client mode (no inbound connections)"), std::string::npos) << client;
  EXPECT_GE(count(client, "hivemind: Averaged tensors successfully with 3 peers"), static_cast<size_t>(kSteps / 2))
      << client;
  EXPECT_EQ(max_difference(weights("trainer0", kSteps), weights("trainer1", kSteps)), 0.0);
  EXPECT_EQ(max_difference(weights("trainer0", kSteps), weights("client", kSteps)), 0.0) << client;
}

// An auxiliary peer (--assist_in_averaging --bandwidth 2) beside two trainers reduces half of each
// pseudo-gradient round (no state round runs) and the trainers end every outer step with the same
// bits.
TEST_F(LocalUpdates, AnAuxiliaryPeerReducesHalfOfEachPseudoGradientRound) {
  constexpr int kSteps = 3;
  const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  const std::string common = "--max_steps " + std::to_string(kSteps) + " --save_interval " + std::to_string(kSteps) +
                             " --target_batch_size 64 --run_id aux-" + std::to_string(::getpid()) +
                             " --matchmaking_time 10 --averaging_timeout 30";
  std::vector<std::unique_ptr<OwnProcess>> peers;
  peers.push_back(peer("aux", "local.json", first, 0, common + " --assist_in_averaging --bandwidth 2"));
  ASSERT_TRUE(polytrain::testing::eventually([&] { return log("aux").find("--initial_peers") != std::string::npos; },
                                             std::chrono::seconds(60)))
      << log("aux");
  for (int k = 1; k <= 2; ++k)
    peers.push_back(peer("trainer" + std::to_string(k), "local.json", first, k, common + " --expected_peers 2"));
  ASSERT_TRUE(all_finish(peers, 240));
  const std::string aux = log("aux");
  EXPECT_EQ(count(aux, "hivemind: assisted in averaging epoch [0-9]+'s pseudo-gradients: reduced 50.0% of them "
                       "\\([0-9]+ of [0-9]+ values\\) from 2 of 2 peers"),
            static_cast<size_t>(kSteps)) << aux;
  EXPECT_EQ(aux.find("'s parameters"), std::string::npos) << aux;
  EXPECT_EQ(max_difference(weights("trainer1", kSteps), weights("trainer2", kSteps)), 0.0);
}
