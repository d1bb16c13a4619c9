// pytorchDDP against the single-process reference, through the real launcher and train_bert
// on the real corpus (the contract later data-parallel backends reuse): with the same seed,
// dropout off and the same global batch (16), world 2 and 4 over Gloo and world 2 over MPI
// reproduce world 1's loss trajectory over 50 steps within 1e-5 relative, and the final
// parameters match to all-reduce rounding. Then: a rank SIGKILLed mid-run (by the pid the
// launcher's --pid_file lists) ends the job quickly and non-zero, and a checkpoint written
// at world size 2 resumes at world size 1 on the same loss curve.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "helpers/own_process.h"
#include "helpers/shipped_config.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/parallel/comm/communicator.h"
#include "helpers/require.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kLaunch = POLYTRAIN_BINARY_DIR "/launch";

struct CmdResult {
  int code;
  std::string out;
  double seconds;
};

CmdResult run(const std::string& cmd) {
  const std::string full = "cd " POLYTRAIN_SOURCE_DIR " && " + cmd + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

bool assets_present() {
  return fs::exists(fs::path(POLYTRAIN_SOURCE_DIR) / ".cache/assets/vocab/bert-base-uncased-vocab.txt");
}

struct Fixture : ::testing::Test {
  fs::path dir;
  int runs_ = 0;
  void SetUp() override {
    PT_SKIP_UNLESS(assets_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
    PT_SKIP_UNLESS(polytrain::comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
    dir = fs::temp_directory_path() / ("pt_ddp_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    // bert_tiny, dropout off, global batch 16; micro and world size come from the flags.
    json c = polytrain::testing::deterministic_bert_tiny(dir / "exp", 0);
    std::ofstream(dir / "config.json") << c.dump(2);
  }
  void TearDown() override {
    if (!dir.empty()) fs::remove_all(dir);
  }

  // Trains and returns {step: loss} from metrics.jsonl of the run named `name`.
  std::map<int64_t, double> train(const std::string& name, const std::string& launch_flags, const std::string& env_type,
                                  int64_t micro, const std::string& extra, CmdResult* out = nullptr) {
    // Each run its own rendezvous port: ctest runs these tests in parallel.
    const std::string port = std::to_string(20000 + (::getpid() * 7 + runs_++ * 131) % 20000);
    const std::string cmd = "OMP_NUM_THREADS=1 " + kLaunch + " --master_port " + port + " " + launch_flags + " train_bert --config '" +
                            (dir / "config.json").string() + "' --env_type " + env_type +
                            " --train_batch_size 16 --train_micro_batch_size_per_gpu " + std::to_string(micro) +
                            " --experiment_name " + name + " --save_dir '" + (dir / name).string() + "' " + extra;
    CmdResult r = run(cmd);
    if (out) *out = r;
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.out;
    std::map<int64_t, double> losses;
    for (const auto& e : fs::recursive_directory_iterator(dir / "exp")) {
      if (e.path().filename() != "metrics.jsonl" || e.path().parent_path().filename() != name) continue;
      std::ifstream f(e.path());
      for (std::string line; std::getline(f, line);) {
        auto j = json::parse(line);
        if (j.contains("loss") && j.contains("step")) losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
      }
    }
    return losses;
  }

  std::map<std::string, at::Tensor> weights(const std::string& name, int64_t step) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : polytrain::load_safetensors((dir / name / ("global_step" + std::to_string(step)) /
                                                     "model.safetensors").string())) {
      m[k] = v;
    }
    return m;
  }
};

void expect_same_curve(const std::map<int64_t, double>& want, const std::map<int64_t, double>& got, int64_t first,
                       int64_t last, double rel, const std::string& what) {
  double worst = 0;
  for (int64_t s = first; s <= last; ++s) {
    ASSERT_TRUE(want.count(s) && got.count(s)) << what << ": no loss logged at step " << s;
    const double d = std::abs(got.at(s) - want.at(s)) / std::abs(want.at(s));
    worst = std::max(worst, d);
    EXPECT_LE(d, rel) << what << " step " << s << ": " << got.at(s) << " vs " << want.at(s);
  }
  std::printf("[ddp] %s: worst relative loss difference over steps %lld..%lld: %.3g\n", what.c_str(),
              static_cast<long long>(first), static_cast<long long>(last), worst);
}

TEST_F(Fixture, DataParallelReproducesSingleProcessTraining) {
  const std::string steps = "--max_steps 50 --save_interval 50";
  // The loss of a step is the mean of its micro-batch losses (each a mean over its masked
  // tokens), so the reference splits the global batch into the same micro-batches.
  auto ref8 = train("w1m8", "--num_gpus 1", "pytorch", 8, steps);  // micro 8, GA 2
  auto ref4 = train("w1m4", "--num_gpus 1", "pytorch", 4, steps);  // micro 4, GA 4
  auto w2 = train("w2", "--num_gpus 2", "pytorchDDP", 8, steps);   // micro 8, GA 1
  auto w4 = train("w4", "--num_gpus 4", "pytorchDDP", 4, steps);   // micro 4, GA 1
  expect_same_curve(ref8, w2, 1, 50, 1e-5, "gloo world 2 vs world 1 (micro 8, GA 2)");
  expect_same_curve(ref4, w4, 1, 50, 1e-5, "gloo world 4 vs world 1 (micro 4, GA 4)");
  EXPECT_LT(ref8.at(50), ref8.at(1));  // it trains
  auto max_diff = [&](const std::string& x, const std::string& y) {
    const auto a = weights(x, 50), b = weights(y, 50);
    double worst = 0;
    for (const auto& [k, v] : a) {
      EXPECT_TRUE(b.count(k)) << k;
      if (b.count(k)) worst = std::max(worst, (b.at(k) - v).abs().max().item<double>());
    }
    std::printf("[ddp] largest parameter difference after 50 steps, %s vs %s: %.3g\n", y.c_str(), x.c_str(), worst);
    return worst;
  };
  EXPECT_LT(max_diff("w1m8", "w2"), 1e-5);
  EXPECT_LT(max_diff("w1m4", "w4"), 1e-5);
  // env_type deepspeed through the launcher and train_bert: ZeRO-2 with the optimizer
  // offloaded (the CPU Adam) follows the same curve.
  auto z2 = train("z2", "--num_gpus 2", "deepspeed", 8, steps + " --zero_stage 2 --offload_optimizer cpu");
  expect_same_curve(ref8, z2, 1, 50, 1e-5, "deepspeed ZeRO-2 + offload world 2 vs world 1 (micro 8, GA 2)");
  EXPECT_LT(max_diff("w1m8", "z2"), 1e-5);
  PT_SKIP_UNLESS(polytrain::comm_engine_available("mpi") && run("command -v mpirun").code == 0,
                 "the MPI leg: a build with MPI and mpirun on PATH (Debian libopenmpi-dev, openmpi-bin)");
#if defined(__SANITIZE_ADDRESS__)
  // Open MPI's own leaks at MPI_Finalize are suppressed by library (tests/sanitizers/lsan.supp);
  // its libraries have no frame pointers, so their stacks reach them only with the slow
  // unwinder (as the mpi_collectives tests): the launcher exports ASAN_OPTIONS to mpirun (-x).
  ::setenv("ASAN_OPTIONS", "fast_unwind_on_malloc=0", 1);
#endif
  auto mpi = train("mpi2", "--launcher openmpi --num_gpus 2", "pytorchDDP", 8, steps);
#if defined(__SANITIZE_ADDRESS__)
  ::unsetenv("ASAN_OPTIONS");
#endif
  expect_same_curve(ref8, mpi, 1, 50, 1e-5, "mpi world 2 vs world 1 (micro 8, GA 2)");
  EXPECT_LT(max_diff("w1m8", "mpi2"), 1e-5);
}

// amp O2 in bf16 on CPU, data-parallel: bf16 weights and gradients (averaged in bf16 over
// Gloo), fp32 master weights on every rank. World 2 follows world 1 (which accumulates the same
// micro-batches in bf16) to bf16 rounding, and both consolidated models hold fp32 masters.
TEST_F(Fixture, AmpO2DataParallelFollowsOneProcess) {
  json c = json::parse(std::ifstream(dir / "config.json"));
  c["amp"] = {{"enabled", true}, {"opt_level", "O2"}, {"dtype", "bfloat16"}};
  std::ofstream(dir / "config.json") << c.dump(2);
  const std::string steps = "--max_steps 30 --save_interval 30";
  CmdResult out;
  auto ref = train("a1", "--num_gpus 1", "pytorch", 8, steps, &out);
  EXPECT_NE(out.out.find("amp O2: bfloat16 weights (normalization layers fp32), fp32 master weights"), std::string::npos)
      << out.out;
  auto w2 = train("a2", "--num_gpus 2", "pytorchDDP", 8, steps);
  expect_same_curve(ref, w2, 1, 30, 2e-2, "amp O2 gloo world 2 vs world 1");
  EXPECT_LT(ref.at(30), ref.at(1));  // it trains
  for (const char* run : {"a1", "a2"})
    for (const auto& [k, v] : weights(run, 30)) EXPECT_EQ(v.scalar_type(), at::kFloat) << run << " " << k;
}

TEST_F(Fixture, KilledRankEndsTheJobAndResumeWorksAtAnotherWorldSize) {
  // The reference: 40 uninterrupted steps at world size 2.
  auto full = train("full", "--num_gpus 2", "pytorchDDP", 8, "--max_steps 40 --save_interval 20");
  // A run that loses rank 1 after its checkpoint at step 20 must end, non-zero, promptly.
  const std::string ckpt = (dir / "part").string();
  const std::string pids = (dir / "part.pids").string();
  const auto t0 = std::chrono::steady_clock::now();
  polytrain::testing::OwnProcess launch(
      "exec env OMP_NUM_THREADS=1 " + kLaunch + " --master_port " + std::to_string(40000 + ::getpid() % 20000) +
          " --num_gpus 2 --pid_file '" + pids + "' train_bert --config '" + (dir / "config.json").string() +
          "' --env_type pytorchDDP --train_batch_size 16 --train_micro_batch_size_per_gpu 8"
          " --experiment_name part --max_steps 1000 --save_interval 20 --save_dir '" + ckpt + "'",
      POLYTRAIN_SOURCE_DIR, (dir / "killed.txt").string());
  // Rank 1, by the pid the launcher lists for it (checked to be still that process), once the
  // step-20 checkpoint is complete.
  ASSERT_TRUE(polytrain::testing::wait_until(
      [&] { return fs::exists(fs::path(ckpt) / "latest") || !launch.running(); }, 500)) << launch.output();
  EXPECT_TRUE(polytrain::testing::signal_listed(polytrain::testing::find_listed(pids, "rank 1 "), SIGKILL))
      << launch.output();
  EXPECT_EQ(launch.wait(), 137) << launch.output();
  EXPECT_NE(launch.output().find("was killed by signal 9"), std::string::npos) << launch.output();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 120.0);
  // Resume its step-20 checkpoint at world size 1 and run to step 40: the same curve.
  fs::remove_all(dir / "resumed");
  fs::create_directories(dir / "resumed");
  const std::string tag = "global_step20";
  fs::copy(ckpt + "/" + tag, dir / "resumed" / tag, fs::copy_options::recursive);
  std::ofstream(dir / "resumed" / "latest") << tag;
  CmdResult r;
  auto resumed = train("resumed", "--num_gpus 1", "pytorchDDP", 8,
                       "--max_steps 40 --save_interval 20 --load_dir '" + (dir / "resumed").string() + "'", &r);
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("saved at world size 2"), std::string::npos) << r.out;
  expect_same_curve(full, resumed, 21, 40, 1e-5, "resumed at world 1 from world 2");
}

}  // namespace
