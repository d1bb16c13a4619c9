// The forged epoch end to end, where vouching alone cannot help: one honest train_bert peer and
// a peer resumed from a checkpoint edited to step 5000 (the review's attack), so that the forger
// is the only other trainer (epoch_vouchers(1) = 1). The throughput rule (progress.h) refuses
// the jump: the honest peer says so, naming the forger, loads nothing, jumps nowhere and ends
// at the run's own step count with the weights of one process training the same samples.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
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
#include "polytrain/checkpoint/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using polytrain::testing::OwnProcess;

namespace {

const std::string kTrainBert = POLYTRAIN_BINARY_DIR "/train_bert";

struct ForgedEpoch : ::testing::Test {
  polytrain::testing::TempDir tmp{"pt_epoch"};
  fs::path dir = tmp.path;
  void SetUp() override {
    PT_SKIP_UNLESS(fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt"),
                   "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
    json c = polytrain::testing::deterministic_bert_tiny(dir / "exp", 1);
    std::ofstream(dir / "config.json") << c.dump(2);
  }
  std::string base(const std::string& name) const {
    return kTrainBert + " --config '" + (dir / "config.json").string() + "' --experiment_name " + name +
           " --save_dir '" + (dir / name).string() + "'";
  }
  std::map<std::string, at::Tensor> weights(const std::string& name, int64_t step) const {
    return polytrain::testing::saved_weights(dir, name, step);
  }
};

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a)
    if (b.count(k)) worst = std::max(worst, (v - b.at(k)).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST_F(ForgedEpoch, AForgerThatIsTheOnlyOtherTrainerCannotMoveTheEpoch) {
  constexpr int kSteps = 6;
  const std::string batch = " --train_batch_size 16 --train_micro_batch_size_per_gpu 16";
  const auto made = polytrain::testing::run_program(base("forged") + " --max_steps 1 --save_interval 1 --env_type pytorch" +
                                                    batch);
  ASSERT_EQ(made.code, 0) << made.out;
  const fs::path marker = dir / "forged" / "global_step1" / "complete.json";
  json m;
  std::ifstream(marker) >> m;
  m["step"] = 5000;
  std::ofstream(marker) << m.dump();

  const std::string first = "127.0.0.1:" + std::to_string(polytrain::testing::free_port());
  const std::string common = " --env_type hivemind" + batch + " --target_batch_size 16 --run_id epoch-forged-" +
                             std::to_string(::getpid()) + " --num_streams 1 --stream_index 0 --matchmaking_time 1 --request_timeout 0.5 --averaging_timeout 2";
  OwnProcess honest("OMP_NUM_THREADS=1 exec " + base("honest") + " --max_steps " + std::to_string(kSteps) +
                        " --save_interval " + std::to_string(kSteps) + common + " --listen " + first,
                    POLYTRAIN_SOURCE_DIR, (dir / "honest.log").string());
  ASSERT_TRUE(polytrain::testing::wait_until(
      [&] { return honest.output().find("step 2/") != std::string::npos || !honest.running(); }, 60))
      << honest.output();
  OwnProcess forger("OMP_NUM_THREADS=1 exec " + base("forger") + " --max_steps 5100 --load_dir '" +
                        (dir / "forged").string() + "'" + common + " --listen 127.0.0.1:0 --initial_peers " + first,
                    POLYTRAIN_SOURCE_DIR, (dir / "forger.log").string());
  const bool done = polytrain::testing::wait_until([&] { return !honest.running(); }, 60);
  const bool forger_ran = forger.running();
  forger.signal(SIGTERM);
  forger.wait();
  if (!done) honest.signal(SIGKILL);
  const std::string out = honest.output();
  if (std::getenv("PT_EPOCH_DEBUG")) std::printf("%s\n----\n%s\n", out.c_str(), forger.output().c_str());
  ASSERT_TRUE(done) << "the honest peer did not finish in 60 s:\n" << out;
  EXPECT_EQ(honest.wait(), 0) << out;
  EXPECT_TRUE(forger_ran) << "the forger ended early:\n" << forger.output();
  EXPECT_NE(forger.output().find("at step 5000"), std::string::npos) << forger.output();
  EXPECT_NE(out.find("claims epoch 5000, beyond what the swarm's throughput allows"), std::string::npos)
      << "the honest peer never saw the forged claim: the test shows nothing\n" << out;
  EXPECT_EQ(out.find("loaded the swarm's state"), std::string::npos) << out;
  EXPECT_EQ(out.find("jumping ahead"), std::string::npos) << out;
  EXPECT_NE(out.find("done: " + std::to_string(kSteps) + " steps"), std::string::npos) << out;
  // Where an unattacked peer ends: one process on the same samples.
  const auto ref = polytrain::testing::run_program(base("ref") + " --max_steps " + std::to_string(kSteps) +
                                                   " --save_interval " + std::to_string(kSteps) + " --env_type pytorch" + batch);
  ASSERT_EQ(ref.code, 0) << ref.out;
  EXPECT_LE(max_difference(weights("ref", kSteps), weights("honest", kSteps)), 1e-5) << out;
}
