// Fault-tolerant data parallelism (trainer.fault_tolerance, docs/fault_tolerance.md): the micro-batch
// plan and the config block alone, then real jobs of tiny BERT under `launch` (3 ranks over Gloo on
// 127.0.0.1) where one rank is killed or stopped after a step: the job exits 0 with every step
// logged and each step's loss equal to an uninterrupted 3-rank run's, or, below min_world_size,
// stops with the lost rank's exit code and a line naming it. With --max_restarts, launch restarts
// the lost rank alone and the replacement rejoins with rank 0's live state.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "helpers/free_port.h"
#include "helpers/own_process.h"
#include "helpers/require.h"
#include "helpers/shipped_config.h"
#include "helpers/temp_dir.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/common/fault_tolerance_config.h"
#include "polytrain/parallel/ddp/fault_tolerance.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using polytrain::MicroBatchSlot;
using polytrain::testing::OwnProcess;
using polytrain::testing::TempDir;
using polytrain::testing::wait_until;

namespace {

std::vector<std::pair<int64_t, int64_t>> pairs(const std::vector<MicroBatchSlot>& plan) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& s : plan) out.emplace_back(s.member, s.index);
  return out;
}

using Pairs = std::vector<std::pair<int64_t, int64_t>>;

}  // namespace

// Every micro-batch of the global batch runs exactly once over the survivors, each its own first.
TEST(FaultTolerancePlan, TheLostMembersMicroBatchesAreDealtOverTheSurvivors) {
  using polytrain::micro_batch_plan;
  EXPECT_EQ(pairs(micro_batch_plan({0, 1}, 3, 2, 0)), (Pairs{{0, 0}, {0, 1}, {2, 0}}));
  EXPECT_EQ(pairs(micro_batch_plan({0, 1}, 3, 2, 1)), (Pairs{{1, 0}, {1, 1}, {2, 1}}));
  EXPECT_EQ(pairs(micro_batch_plan({0, 2}, 4, 1, 2)), (Pairs{{2, 0}, {3, 0}}));
  EXPECT_EQ(pairs(micro_batch_plan({0, 2}, 4, 1, 0)), (Pairs{{0, 0}, {1, 0}}));
  EXPECT_EQ(pairs(micro_batch_plan({0, 1, 2}, 3, 2, 1)), (Pairs{{1, 0}, {1, 1}}));
  // Over all survivors: each (member, index) of 5 members x 3 micro-batches once.
  std::map<std::pair<int64_t, int64_t>, int> seen;
  for (int64_t me : {1, 4})
    for (auto p : pairs(micro_batch_plan({1, 4}, 5, 3, me))) ++seen[p];
  EXPECT_EQ(seen.size(), 15u);
  for (const auto& [slot, n] : seen) EXPECT_EQ(n, 1) << slot.first << "/" << slot.second;
}

namespace {

// The rendezvous store's calls over an in-memory map (one process plays every survivor in turn).
// Safe to use from several threads (a test's late registrant), as the TCPStore it stands for.
polytrain::StoreOps memory_store(std::map<std::string, std::string>& kv) {
  auto mu = std::make_shared<std::mutex>();
  polytrain::StoreOps ops;
  ops.set = [&kv, mu](const std::string& k, const std::string& v) {
    std::lock_guard<std::mutex> l(*mu);
    kv[k] = v;
  };
  ops.has = [&kv, mu](const std::string& k) {
    std::lock_guard<std::mutex> l(*mu);
    return kv.count(k) > 0;
  };
  ops.set_once = [&kv, mu](const std::string& k, const std::string& v) {
    std::lock_guard<std::mutex> l(*mu);
    return kv.emplace(k, v).first->second;
  };
  ops.get = [&kv, mu](const std::string& k) {
    std::lock_guard<std::mutex> l(*mu);
    return kv.at(k);
  };
  return ops;
}

}  // namespace

// The quorum: whoever has registered when the wait ends is in; a later survivor is told it is
// out; survivors at different steps are an error.
TEST(FaultToleranceQuorum, WhoRegisteredInTimeFormsTheGroup) {
  using polytrain::agree_membership;
  using std::chrono::milliseconds;
  std::map<std::string, std::string> kv;
  const auto store = memory_store(kv);
  kv["ft/g1/alive/1"] = "5";  // rank 1 registered first, at step 5
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(agree_membership(store, 1, 0, {0, 1, 2}, 5, milliseconds(200)), (std::vector<int64_t>{0, 1}));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(200)) << "waits for rank 2 until the quorum closes";
  EXPECT_EQ(agree_membership(store, 1, 1, {0, 1, 2}, 5, milliseconds(200)), (std::vector<int64_t>{0, 1}));
  try {
    agree_membership(store, 1, 2, {0, 1, 2}, 5, milliseconds(200));
    ADD_FAILURE() << "rank 2 came after the quorum closed";
  } catch (const polytrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 reached the quorum of membership generation 1 after it closed"),
              std::string::npos)
        << e.what();
  }
  // Everyone in: no wait. A survivor one step ahead: an error naming both steps.
  kv["ft/g2/alive/1"] = "6";
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_THROW(agree_membership(store, 2, 0, {0, 1}, 5, milliseconds(5000)), polytrain::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t1, milliseconds(2000));
}

// Rank 0 hosts the store, so the quorum waits past `settle` for it: a rank 0 that registers
// late (a loaded machine) is still in, and the others go on with it instead of without the store.
TEST(FaultToleranceQuorum, RankZeroLateIsWaitedFor) {
  using std::chrono::milliseconds;
  std::map<std::string, std::string> kv;
  const auto store = memory_store(kv);
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(600));
    store.set("ft/g1/alive/0", "5");
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(polytrain::agree_membership(store, 1, 1, {0, 1, 2}, 5, milliseconds(100)), (std::vector<int64_t>{0, 1}));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(550));
  late.join();
  // Without rank 0 among the previous members (it cannot be: it is the store), settle alone.
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(polytrain::agree_membership(store, 2, 1, {1, 2}, 5, milliseconds(100)), (std::vector<int64_t>{1}));
  EXPECT_LT(std::chrono::steady_clock::now() - t1, milliseconds(2000));
}

// A replacement's admission through the store: rank 0 sees each pending request once (a later
// attempt of the same rank again), the replacement reads the group it is admitted to.
TEST(FaultToleranceJoin, TheStoreProtocol) {
  using namespace polytrain;
  std::map<std::string, std::string> kv;
  const auto store = memory_store(kv);
  std::vector<int64_t> admitted(3, 0);
  EXPECT_EQ(pending_joins(store, {0, 1}, 3, admitted), (std::vector<int64_t>{-1, -1, -1}));
  request_join(store, 2, 1);
  EXPECT_EQ(pending_joins(store, {0, 1}, 3, admitted), (std::vector<int64_t>{-1, -1, 1}));
  EXPECT_EQ(pending_joins(store, {0, 1, 2}, 3, admitted), (std::vector<int64_t>{-1, -1, -1})) << "a member is not pending";
  Admission a;
  a.generation = 2, a.members = {0, 1, 2}, a.step = 7, a.shared = {"/x/checkpoints", ""};
  write_admission(store, 2, 1, a);
  admitted[2] = 1;
  EXPECT_EQ(pending_joins(store, {0, 1}, 3, admitted), (std::vector<int64_t>{-1, -1, -1})) << "admitted already";
  const Admission b = await_admission(store, 2, 1, std::chrono::steady_clock::now());
  EXPECT_EQ(b.generation, 2);
  EXPECT_EQ(b.members, a.members);
  EXPECT_EQ(b.step, 7);
  EXPECT_EQ(b.shared, a.shared);
  request_join(store, 2, 2);  // lost again, replaced again
  EXPECT_EQ(pending_joins(store, {0, 1}, 3, admitted), (std::vector<int64_t>{-1, -1, 2}));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(await_admission(store, 2, 2, t0 + std::chrono::milliseconds(100)), Error) << "never admitted";
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(100));
}

TEST(FaultToleranceConfig, ShapesAndErrors) {
  using polytrain::parse_fault_tolerance;
  EXPECT_TRUE(parse_fault_tolerance(json(true), "c.json").enabled);
  EXPECT_FALSE(parse_fault_tolerance(json(nullptr), "c.json").enabled);
  const auto o = parse_fault_tolerance(json{{"min_world_size", 2}}, "c.json");
  EXPECT_TRUE(o.enabled);
  EXPECT_EQ(o.min_world_size, 2);
  EXPECT_FALSE(parse_fault_tolerance(json{{"enabled", false}, {"min_world_size", 2}}, "c.json").enabled);
  EXPECT_EQ(o.quorum_wait, 2.0);
  EXPECT_EQ(parse_fault_tolerance(json{{"quorum_wait", 0.5}}, "c.json").quorum_wait, 0.5);
  for (const json& bad : {json("yes"), json{{"min_world_size", 0}}, json{{"min_ranks", 2}}, json{{"enabled", 1}},
                          json{{"quorum_wait", 0}}}) {
    try {
      parse_fault_tolerance(bad, "c.json");
      ADD_FAILURE() << bad.dump() << " was accepted";
    } catch (const polytrain::InputError& e) {
      EXPECT_NE(std::string(e.what()).find("c.json: 'trainer.fault_tolerance"), std::string::npos) << e.what();
    }
  }
  // A config file takes the block; Open MPI has no ULFM: refused; auto becomes gloo.
  json doc = {{"train_batch_size", 4}, {"trainer", {{"fault_tolerance", {{"min_world_size", 2}}}, {"comm_backend", "mpi"}}}};
  polytrain::Config cfg = polytrain::config_from_json(doc, "c.json", 2);
  EXPECT_THROW(polytrain::resolve_fault_tolerance(cfg, "c.json"), polytrain::InputError);
  cfg.trainer.comm_backend = "auto";
  polytrain::resolve_fault_tolerance(cfg, "c.json");
  EXPECT_EQ(cfg.trainer.comm_backend, "gloo");
  EXPECT_EQ(polytrain::fault_tolerance_options(cfg).min_world_size, 2);
  EXPECT_TRUE(polytrain::fault_tolerance_options(cfg).enabled);
}

namespace {

using polytrain::testing::bert_vocab_present;

const std::string kLaunch = POLYTRAIN_BINARY_DIR "/launch";
const std::string kTrain = POLYTRAIN_BINARY_DIR "/train_bert";

struct Job {
  int code = -1;
  std::string out;
  double seconds = 0;
  std::map<int64_t, double> losses;  // step -> loss, from metrics.jsonl
  std::vector<json> membership;      // the membership_change records
};

// `launch --num_gpus 3 train_bert` on tiny BERT (64 tokens, 12 samples a step as 3 ranks x 2
// micro-batches of 2: a lost rank leaves two micro-batches to redistribute), 20 steps.
// The quorum's wait in the tests where two survivors must agree: 6 s, not the default 2, since
// ctest -j2 runs another multi-rank job beside these 3 ranks on 2 cores, and a survivor once
// registered more than 2 s after the other (the quorum then closed without it).
constexpr double kLoadedQuorum = 6.0;

Job run_job(const TempDir& t, const std::string& name, const std::string& env, const std::string& flags,
            double deadline_s, const std::string& env_type = "pytorchDDP", const std::string& launch_flags = "",
            double quorum_wait = 0) {
  json cfg = polytrain::testing::shipped_config("bert_tiny.json");
  cfg["data"]["max_seq_length"] = 64;
  cfg["trainer"]["comm_timeout"] = 6;  // a stopped rank is found by its peers' deadline
  if (quorum_wait > 0) cfg["trainer"]["fault_tolerance"] = json{{"enabled", true}, {"quorum_wait", quorum_wait}};
  const fs::path dir = t.path / name;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << cfg.dump(2);
  const std::string cmd = "exec env OMP_NUM_THREADS=1 HOME='" + t.path.string() + "' " + env + " " + kLaunch +
                          " --num_gpus 3 --master_port " + std::to_string(polytrain::testing::free_port()) + " " +
                          launch_flags + " " + kTrain + " --config '" + (dir / "config.json").string() +
                          "' --env_type " + env_type + " --max_steps 20 --train_batch_size 12"
                          " --train_micro_batch_size_per_gpu 2 --log_interval 1 --eval_interval 1000 --no_progress_bar"
                          " --num_threads 1 --experiments_dir '" + (dir / "exp").string() + "'" + flags;
  const auto t0 = std::chrono::steady_clock::now();
  OwnProcess launch(cmd, POLYTRAIN_SOURCE_DIR, (dir / "out.txt").string());
  Job j;
  const bool ended = wait_until([&] { return !launch.running(); }, deadline_s, 100);
  j.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  j.code = ended ? launch.wait() : -1;  // past the deadline the launcher is killed with its group
  j.out = launch.output();
  if (!fs::exists(dir / "exp")) return j;  // a run refused before its first step leaves no folder
  for (const auto& e : fs::recursive_directory_iterator(dir / "exp", fs::directory_options::skip_permission_denied)) {
    if (e.path().filename() != "metrics.jsonl") continue;
    std::ifstream in(e.path());
    for (std::string line; std::getline(in, line);) {
      const json r = json::parse(line);
      if (r.contains("loss") && r.contains("lr")) j.losses[r["step"].get<int64_t>()] = r["loss"].get<double>();
      if (r.value("event", "") == "membership_change") j.membership.push_back(r);
    }
  }
  return j;
}

void expect_same_losses(const Job& uninterrupted, const Job& survived) {
  ASSERT_EQ(uninterrupted.losses.size(), 20u) << uninterrupted.out;
  ASSERT_EQ(survived.losses.size(), 20u) << survived.out;
  double worst = 0;
  for (const auto& [step, loss] : uninterrupted.losses) {
    const double rel = std::abs(survived.losses.at(step) - loss) / std::abs(loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "step " << step << ": " << survived.losses.at(step) << " against " << loss;
  }
  std::printf("[fault tolerance] worst relative loss difference over 20 steps: %.3g; %.1f s against %.1f s\n", worst,
              survived.seconds, uninterrupted.seconds);
}

// The uninterrupted 3-rank run, once per test program (the tests compare with its losses).
const Job& uninterrupted() {
  static const TempDir t("pt_ft_base");
  static const Job base = run_job(t, "uninterrupted", "", "", 120);
  return base;
}

int count_step_lines(const std::string& out) {
  const std::regex step_line("\\[rank 0\\] step ([0-9]+)/20 \\|");
  return static_cast<int>(std::distance(std::sregex_iterator(out.begin(), out.end(), step_line), std::sregex_iterator()));
}

}  // namespace

// The must-show run: rank 2 SIGKILLed after step 5; survivors redo step 6 over the same 12 samples.
TEST(FaultTolerance, ARankKilledAfterStep5CostsOneRetryNotTheJob) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "killed", "POLYTRAIN_FAULT=2:step:5:KILL", " --fault_tolerance", 120, "pytorchDDP", "", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  EXPECT_NE(ft.out.find("[rank 0] fault tolerance: rank 2 left at step 6 ("), std::string::npos) << ft.out;
  EXPECT_NE(ft.out.find("step 6 redone over the same 12 samples"), std::string::npos) << ft.out;
  ASSERT_EQ(ft.membership.size(), 1u) << ft.out;
  EXPECT_EQ(ft.membership[0]["left"], json::array({2}));
  EXPECT_EQ(ft.membership[0]["members"], json::array({0, 1}));
  EXPECT_EQ(ft.membership[0]["step"], 6);
  EXPECT_GT(ft.membership[0]["seconds_lost"].get<double>(), 0.0);
  expect_same_losses(base, ft);
  EXPECT_LE(ft.seconds, base.seconds + 60) << ft.out;
}

// Silent rather than dead: rank 2 SIGSTOPped after step 5 is found by comm_timeout (6 s), left out
// of the group, and killed by the launcher once the survivors say it left.
TEST(FaultTolerance, AStoppedRankIsLeftOutAndTheJobEndsWell) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "stopped", "POLYTRAIN_FAULT=2:step:5:STOP", " --fault_tolerance", 120, "pytorchDDP", "", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  EXPECT_NE(ft.out.find("fault tolerance: rank 2 left at step 6"), std::string::npos) << ft.out;
  EXPECT_NE(ft.out.find("launch: rank 2"), std::string::npos) << "the launcher reports the rank it killed\n" << ft.out;
  expect_same_losses(base, ft);
}

// Two failures in one run, the second inside a collective: rank 2 killed after step 5, then rank 1
// killed in the middle of step 12's gradient all-reduce (POLYTRAIN_FAULT's 'allreduce' point is
// passed twice a step with one bucket); rank 0 finishes alone, every step still the same.
TEST(FaultTolerance, TwoFailuresTheSecondMidAllReduce) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "twice", "POLYTRAIN_FAULT=2:step:5:KILL,1:allreduce:23:KILL",
                         " --fault_tolerance", 120, "pytorchDDP", "", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  ASSERT_EQ(ft.membership.size(), 2u) << ft.out;
  EXPECT_EQ(ft.membership[0]["left"], json::array({2}));
  EXPECT_EQ(ft.membership[1]["left"], json::array({1}));
  EXPECT_EQ(ft.membership[1]["members"], json::array({0}));
  EXPECT_EQ(ft.membership[1]["generation"], 2);
  EXPECT_EQ(ft.membership[1]["step"], 12);
  expect_same_losses(base, ft);
}

// A failure during the recovery: rank 1 is killed as the new group of ranks 0 and 1 connects
// (POLYTRAIN_FAULT's 'rendezvous' point, passed a second time there). Rank 0's connect fails at
// comm_timeout, a second quorum leaves it alone, and it redoes step 6 by itself.
TEST(FaultTolerance, ARankLostWhileTheNewGroupConnects) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "regroup", "POLYTRAIN_FAULT=2:step:5:KILL,1:rendezvous:2:KILL",
                         " --fault_tolerance", 120, "pytorchDDP", "", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  ASSERT_EQ(ft.membership.size(), 1u) << ft.out;
  EXPECT_EQ(ft.membership[0]["left"], json::array({1, 2})) << ft.out;
  EXPECT_EQ(ft.membership[0]["members"], json::array({0})) << ft.out;
  EXPECT_EQ(ft.membership[0]["generation"], 2) << ft.out;
  EXPECT_NE(ft.out.find("fault tolerance: ranks 1, 2 left at step 6"), std::string::npos) << ft.out;
  expect_same_losses(base, ft);
}

// A rank killed after step 8, whose checkpoint is the next collective: the survivors fail at the
// save's first barrier, write that checkpoint again and train on; the last checkpoint loads.
TEST(FaultTolerance, ARankLostAtACheckpointSave) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const std::string ckpt = (t.path / "ckpt").string();
  const Job ft = run_job(t, "save", "POLYTRAIN_FAULT=2:step:8:KILL",
                         " --fault_tolerance --save_interval 4 --save_dir '" + ckpt + "'", 120, "pytorchDDP", "",
                         kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  ASSERT_EQ(ft.membership.size(), 1u) << ft.out;
  EXPECT_EQ(ft.membership[0]["when"], "during the checkpoint of step 8");
  EXPECT_NE(ft.out.find("the checkpoint of step 8 redone"), std::string::npos) << ft.out;
  expect_same_losses(base, ft);
  std::string latest;
  std::ifstream(fs::path(ckpt) / "latest") >> latest;
  EXPECT_EQ(latest, "global_step20");
  for (const auto& e : fs::directory_iterator(ckpt))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path() << " is left";
  // The last checkpoint loads: one process resumes from it and takes a step (its config without
  // the fault tolerance, which a single pytorch process refuses).
  json one;
  std::ifstream(t.path / "save" / "config.json") >> one;
  one["trainer"].erase("fault_tolerance");
  std::ofstream(t.path / "resume.json") << one.dump(2);
  const std::string resume = "cd '" + std::string(POLYTRAIN_SOURCE_DIR) + "' && env OMP_NUM_THREADS=1 HOME='" +
                             t.path.string() + "' " + kTrain + " --config '" + (t.path / "resume.json").string() +
                             "' --load_dir '" + ckpt + "' --save_dir '" + (t.path / "resumed").string() +
                             "' --max_steps 21 --train_batch_size 12 --no_progress_bar --num_threads 1 --experiments_dir '" +
                             (t.path / "exp1").string() + "' 2>&1";
  FILE* p = ::popen(resume.c_str(), "r");
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "/global_step20 at step 20"), std::string::npos) << out;
}

namespace {

int count_of(const std::string& out, const std::string& what) {
  int n = 0;
  for (size_t at = out.find(what); at != std::string::npos; at = out.find(what, at + 1)) ++n;
  return n;
}

std::vector<int64_t> ranks_of(const json& record, const char* key) {
  return record.contains(key) ? record[key].get<std::vector<int64_t>>() : std::vector<int64_t>{};
}

}  // namespace

// Replacement: rank 2 SIGKILLed after step 5 with --max_restarts 1. launch restarts rank 2 alone;
// the survivors redo step 6 without it, the replacement joins at a later step boundary with
// rank 0's live state (no checkpoint), the group is 3 ranks again and every step equals the
// uninterrupted run's.
TEST(FaultTolerance, AKilledRankIsReplacedAndTheGroupGrowsBack) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "replaced", "POLYTRAIN_FAULT=2:step:5:KILL", " --fault_tolerance", 55, "pytorchDDP",
                         "--max_restarts 1", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  // Only rank 2 is restarted, once; the group never is.
  EXPECT_EQ(count_of(ft.out, "restarting it (restart 1 of 1)"), 1) << ft.out;
  EXPECT_NE(ft.out.find("launch: rank 2 (host localhost) (pid"), std::string::npos) << ft.out;
  EXPECT_EQ(ft.out.find("launch: restarting the group"), std::string::npos) << ft.out;
  EXPECT_EQ(ft.out.find("resumed from"), std::string::npos) << "a replacement loads no checkpoint\n" << ft.out;
  ASSERT_EQ(ft.membership.size(), 2u) << ft.out;
  EXPECT_EQ(ranks_of(ft.membership[0], "left"), (std::vector<int64_t>{2}));
  EXPECT_EQ(ft.membership[0]["step"], 6);
  EXPECT_EQ(ranks_of(ft.membership[1], "joined"), (std::vector<int64_t>{2}));
  EXPECT_EQ(ranks_of(ft.membership[1], "members"), (std::vector<int64_t>{0, 1, 2})) << "the group is back to 3 ranks";
  const int64_t joined_at = ft.membership[1]["step"].get<int64_t>();
  EXPECT_GT(joined_at, 6);
  EXPECT_LE(joined_at, 20);
  EXPECT_NE(ft.out.find("[rank 0] fault tolerance: rank 2 joined at step " + std::to_string(joined_at)), std::string::npos)
      << ft.out;
  expect_same_losses(base, ft);
  EXPECT_LE(ft.seconds, 55) << ft.out;
}

// A failure during the replacement's state transfer: rank 2 is killed after step 5 and replaced;
// rank 1 kills itself as the live state is about to go to the replacement (POLYTRAIN_FAULT's
// 'join' point). Rank 0 and the replacement regroup and redo the transfer; rank 1's own
// replacement joins later. Nobody hangs, the job ends with 3 ranks and every step is the same.
TEST(FaultTolerance, ARankLostDuringAReplacementsStateTransfer) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job& base = uninterrupted();
  ASSERT_EQ(base.code, 0) << base.out;
  const Job ft = run_job(t, "transfer", "POLYTRAIN_FAULT=2:step:5:KILL,1:join:1:KILL", " --fault_tolerance", 55,
                         "pytorchDDP", "--max_restarts 1", kLoadedQuorum);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_EQ(count_step_lines(ft.out), 20) << ft.out;
  EXPECT_NE(ft.out.find("sends itself SIGKILL at 'join'"), std::string::npos) << ft.out;
  EXPECT_EQ(count_of(ft.out, "restarting it (restart 1 of 1)"), 2) << "ranks 1 and 2, once each\n" << ft.out;
  std::vector<int64_t> left, joined;
  for (const auto& r : ft.membership) {
    for (int64_t m : ranks_of(r, "left")) left.push_back(m);
    for (int64_t m : ranks_of(r, "joined")) joined.push_back(m);
  }
  EXPECT_EQ(left, (std::vector<int64_t>{2, 1})) << ft.out;
  std::sort(joined.begin(), joined.end());
  EXPECT_EQ(joined, (std::vector<int64_t>{1, 2})) << ft.out;
  ASSERT_FALSE(ft.membership.empty());
  EXPECT_EQ(ranks_of(ft.membership.back(), "members"), (std::vector<int64_t>{0, 1, 2})) << ft.out;
  expect_same_losses(base, ft);
  EXPECT_LE(ft.seconds, 55) << ft.out;
}

// Below min_world_size the job stops as without fault tolerance: the lost rank's exit code, and a
// line that names it.
TEST(FaultTolerance, BelowMinWorldSizeTheJobStopsNamingTheLostRank) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job ft = run_job(t, "below", "POLYTRAIN_FAULT=2:step:5:KILL",
                         " --fault_tolerance --min_world_size 3", 120);
  EXPECT_EQ(ft.code, 137) << ft.out;
  EXPECT_NE(ft.out.find("error: fault tolerance: rank 2 of 3 lost at step 6; 2 left, below "
                        "trainer.fault_tolerance.min_world_size 3: the job stops"),
            std::string::npos)
      << ft.out;
  EXPECT_LT(count_step_lines(ft.out), 20) << ft.out;
}

// What cannot survive a lost rank says so in one line before anything runs.
TEST(FaultTolerance, RefusedWhereItCannotWork) {
  PT_SKIP_UNLESS(bert_vocab_present(), "the BERT vocab in .cache/assets (scripts/fetch_assets.sh)");
  TempDir t("pt_ft");
  const Job zero = run_job(t, "zero", "", " --fault_tolerance --zero_stage 2", 60, "deepspeed");
  EXPECT_EQ(zero.code, 2) << zero.out;
  EXPECT_NE(zero.out.find("error: trainer.fault_tolerance: env_type deepspeed with ZeRO cannot survive lost ranks"),
            std::string::npos)
      << zero.out;
}
