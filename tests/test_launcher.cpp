// The launcher's pure parts, table-driven as DeepSpeed's runner tests are: hostfile parsing,
// --include/--exclude, --num_nodes/--num_gpus, the world plan and worker environment, the
// .deepspeed_env file, the pdsh / ssh / mpirun / srun command lines, and the OpenBLAS kernel
// chosen for the workers by CPU features (recorded /proc/cpuinfo samples).
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "polytrain/common/blas_kernel.h"
#include "polytrain/common/error.h"
#include "polytrain/launcher/env_file.h"
#include "polytrain/launcher/hostfile.h"
#include "polytrain/launcher/plan.h"
#include "polytrain/launcher/runners.h"

using namespace polytrain;
using namespace polytrain::launcher;

namespace {

std::string show(const ResourcePool& p) { return encode_pool(p); }

// The error text of f(), or "" when it does not throw InputError.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Hostfile, ParsesDeepSpeedFormat) {
  const auto pool = parse_hostfile(
      "# cluster\n"
      "\n"
      "worker-0 slots=4\n"
      "   worker-1   slots=2   # trailing comment\n"
      "\t\n"
      "10.0.0.3 slots=1\n",
      "hf");
  EXPECT_EQ(show(pool), "worker-0:0,1,2,3@worker-1:0,1@10.0.0.3:0");
}

struct BadHostfile {
  const char* text;
  const char* expect;  // substring of the error
};
// What ctest shows after the case's name (CMake 3.25 puts GetParam()'s print into it).
void PrintTo(const BadHostfile& c, std::ostream* os) { *os << c.expect; }

class HostfileErrors : public ::testing::TestWithParam<BadHostfile> {};

TEST_P(HostfileErrors, NameFileAndLine) {
  const auto c = GetParam();
  const std::string err = error_of([&] { parse_hostfile(c.text, "hosts.txt"); });
  EXPECT_NE(err.find(c.expect), std::string::npos) << err;
}

INSTANTIATE_TEST_SUITE_P(
    Table, HostfileErrors,
    ::testing::Values(BadHostfile{"", "hosts.txt: hostfile lists no host"},
                      BadHostfile{"# only comments\n\n", "lists no host"},
                      BadHostfile{"a slots=2\nb slots=2\na slots=1\n", "hosts.txt:3: host 'a' is listed more than once"},
                      BadHostfile{"a slots=2\nb\n", "hosts.txt:2: bad hostfile entry 'b'"},
                      BadHostfile{"a slot=2\n", "hosts.txt:1: bad hostfile entry"},
                      BadHostfile{"a slots=x\n", "hosts.txt:1: bad hostfile entry"},
                      BadHostfile{"a slots=2 extra\n", "hosts.txt:1: bad hostfile entry"},
                      BadHostfile{"a slots=0\n", "hosts.txt:1: host 'a' has slots=0"},
                      BadHostfile{"a:1 slots=2\n", "hosts.txt:1: 'a:1' is not a host name"},
                      BadHostfile{"ok slots=1\nb\x1b[2Jad slots=2\n", "hosts.txt:2: 'b\\x1b[2Jad' is not a host name"},
                      BadHostfile{"a;rm slots=2\n", "'a;rm' is not a host name"},
                      BadHostfile{"a..b slots=2\n", "'a..b' is not a host name"},
                      BadHostfile{"a slots=70000\n", "host 'a' has slots=70000 (must be 1 to 65536)"}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

TEST(Hostfile, MissingFileIsNamed) {
  EXPECT_NE(error_of([] { read_hostfile("/nonexistent/hostfile"); }).find("'/nonexistent/hostfile' cannot be read"),
            std::string::npos);
}

struct FilterCase {
  const char* include;
  const char* exclude;
  const char* expect;  // encoded pool, or "!substring of the error"
};
void PrintTo(const FilterCase& c, std::ostream* os) { *os << "include '" << c.include << "' exclude '" << c.exclude << "'"; }

class Filter : public ::testing::TestWithParam<FilterCase> {};

TEST_P(Filter, DeepSpeedSemantics) {
  const auto pool = parse_hostfile("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\n", "hf");
  const auto c = GetParam();
  const std::string want = c.expect;
  if (want[0] == '!') {
    const std::string err = error_of([&] { filter_resources(pool, c.include, c.exclude); });
    EXPECT_NE(err.find(want.substr(1)), std::string::npos) << err;
  } else {
    EXPECT_EQ(show(filter_resources(pool, c.include, c.exclude)), want);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, Filter,
    ::testing::Values(
        FilterCase{"", "", "worker-0:0,1,2,3@worker-1:0,1,2,3@worker-2:0,1"},
        FilterCase{"worker-1", "", "worker-1:0,1,2,3"},
        FilterCase{"worker-1:0,2", "", "worker-1:0,2"},
        // hostfile order is rank order, whatever order the filter names hosts in
        FilterCase{"worker-2@worker-0:3", "", "worker-0:3@worker-2:0,1"},
        // slots of a repeated host merge, sorted and deduplicated
        FilterCase{"worker-0:3,1@worker-0:1,0", "", "worker-0:0,1,3"},
        FilterCase{"worker-0:2@worker-0", "", "worker-0:0,1,2,3"},
        FilterCase{"", "worker-1", "worker-0:0,1,2,3@worker-2:0,1"},
        FilterCase{"", "worker-0:0,3@worker-2:1", "worker-0:1,2@worker-1:0,1,2,3@worker-2:0"},
        // a host left with no slot drops out
        FilterCase{"", "worker-2:0,1", "worker-0:0,1,2,3@worker-1:0,1,2,3"},
        FilterCase{"", "worker-0@worker-1@worker-2", "!leaves nothing to run"},
        FilterCase{"worker-0", "worker-1", "!--include and --exclude cannot be used together"},
        FilterCase{"worker-9", "", "!--include: host 'worker-9' is not in the hostfile"},
        FilterCase{"", "worker-9:0", "!--exclude: host 'worker-9' is not in the hostfile"},
        FilterCase{"worker-2:2", "", "!host 'worker-2' has no slot 2"},
        FilterCase{"worker-0:a", "", "!slot 'a' of host 'worker-0' is not a number"},
        FilterCase{"worker-0:", "", "!has ':' but no slots"},
        FilterCase{"@worker-0", "", "!empty host name"},
        FilterCase{"worker-0@", "", "!empty host name"}),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// DeepSpeed's own test cases (tests/unit/launcher/test_run.py), verbatim.
TEST(Filter, DeepSpeedRunnerCases) {
  const auto one = parse_hostfile("worker-0 slots=4\n", "hf");
  EXPECT_EQ(show(filter_resources(one, "", "worker-0:1")), "worker-0:0,2,3");
  EXPECT_EQ(show(filter_resources(one, "worker-0:1,1", "")), "worker-0:1");
  EXPECT_EQ(show(filter_resources(one, "worker-0:1@worker-0:0,1", "")), "worker-0:0,1");
  const auto two = parse_hostfile("worker-0 slots=4\nworker-1 slots=4\n", "hf");
  EXPECT_EQ(show(filter_resources(two, "", "worker-0:0,1@worker-1:3")), "worker-0:2,3@worker-1:0,1,2");
  EXPECT_NE(error_of([&] { filter_resources(two, "jeff", ""); }), "");
  EXPECT_NE(error_of([&] { filter_resources(two, "worker-1:4", ""); }), "");
  EXPECT_NE(error_of([&] { filter_resources(two, "worker-1@worker-0:1@5", ""); }), "");
}

TEST(Limit, NumNodesAndNumGpus) {
  const auto pool = parse_hostfile("a slots=4\nb slots=4\nc slots=2\n", "hf");
  EXPECT_EQ(show(limit_resources(pool, 2, -1)), "a:0,1,2,3@b:0,1,2,3");
  EXPECT_EQ(show(limit_resources(pool, -1, 2)), "a:0,1@b:0,1@c:0,1");
  EXPECT_EQ(show(limit_resources(pool, 1, 1)), "a:0");
  EXPECT_NE(error_of([&] { limit_resources(pool, 4, -1); }).find("--num_nodes 4: the hostfile lists only 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { limit_resources(pool, -1, 3); }).find("host 'c' has only 2 slot(s)"), std::string::npos);
}

TEST(Pool, EncodeDecodeRoundTrip) {
  const std::string s = "a:1,3@b:0";
  EXPECT_EQ(encode_pool(decode_pool(s)), s);
  EXPECT_NE(error_of([] { decode_pool("a"); }).find("has no slots"), std::string::npos);
  EXPECT_NE(error_of([] { decode_pool("a:0@a:1"); }).find("repeated"), std::string::npos);
}

TEST(Hostfile, HostNamesFollowDns) {
  EXPECT_TRUE(valid_host_name("worker-0"));
  EXPECT_TRUE(valid_host_name("node_7.cluster.example"));
  EXPECT_TRUE(valid_host_name("10.0.0.3"));
  EXPECT_TRUE(valid_host_name("fqdn.example."));
  EXPECT_TRUE(valid_host_name(std::string(63, 'a') + "." + std::string(63, 'b')));
  EXPECT_FALSE(valid_host_name(std::string(64, 'a')));                     // a label over 63
  EXPECT_FALSE(valid_host_name(std::string(4, '.') + "a"));
  std::string long_name;
  for (int i = 0; i < 64; ++i) long_name += "abc.";
  EXPECT_FALSE(valid_host_name(long_name + "x"));                          // over 253 in all
  for (const char* bad : {"", ".", "a b", "a\tb", "a\nb", "a'b", "$(id)", "a:1", "a@b", "a,b", "\xc3\xa9t\xc3\xa9"})
    EXPECT_FALSE(valid_host_name(bad)) << bad;
  // The long name's error is bounded, not the whole name.
  const std::string err = error_of([&] { parse_hostfile(std::string(5000, 'x') + " slots=1\n", "hf"); });
  EXPECT_LT(err.size(), 300u) << err;
  EXPECT_NE(error_of([&] { make_plan({{"a", {0}}}, "bad addr", 29500, false); }).find("--master_addr"), std::string::npos);
}

TEST(Layout, SlotListsAndRunLengthLayouts) {
  EXPECT_EQ(encode_slots({0, 1, 2, 3, 4, 5, 6, 7}), "0-7");
  EXPECT_EQ(encode_slots({1, 3}), "1,3");
  EXPECT_EQ(encode_slots({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(decode_slots("0-2,5,7-8", "f"), (std::vector<int>{0, 1, 2, 5, 7, 8}));
  for (const char* bad : {"", "3,1", "1,1", "2-1", "a", "0-", "1,", "0-99999999", "-1"})
    EXPECT_NE(error_of([&] { decode_slots(bad, "--node_slots"); }).find("--node_slots"), std::string::npos) << bad;
  ResourcePool big;
  for (int i = 0; i < 10000; ++i) big.push_back({"worker-" + std::to_string(i), {0, 1, 2, 3, 4, 5, 6, 7}});
  EXPECT_EQ(encode_slot_layout(big), "10000x0-7");
  const auto v = node_in_layout("10000x0-7", 9999);
  EXPECT_EQ(v.slots.size(), 8u);
  EXPECT_EQ(v.rank_offset, 79992);
  EXPECT_EQ(v.world_size, 80000);
  EXPECT_EQ(v.num_nodes, 10000);
  const auto pool = decode_pool("h1:1,3@h2:0,1,2,3@h3:0,1,2,3@h4:0");
  EXPECT_EQ(encode_slot_layout(pool), "1x1,3@2x0-3@1x0");
  const auto plan = make_plan(pool, "", 29500, true);
  for (int k = 0; k < 4; ++k) {  // the layout gives every node what the full plan gives it
    const auto n = node_in_layout(encode_slot_layout(pool), k);
    EXPECT_EQ(n.slots, plan.nodes[k].slots);
    EXPECT_EQ(n.rank_offset, plan.nodes[k].ranks.front());
    EXPECT_EQ(n.world_size, 11);
    EXPECT_EQ(n.num_nodes, 4);
    const auto node = make_node_plan(plan.nodes[k].host, k, n.slots, n.rank_offset, n.world_size, n.num_nodes,
                                     plan.master_addr, 29500, true);
    for (int i = 0; i < static_cast<int>(n.slots.size()); ++i) EXPECT_EQ(worker_env(node, k, i, 1), worker_env(plan, k, i, 1));
  }
  EXPECT_NE(error_of([] { node_in_layout("2x0-3", 2); }).find("--node_rank 2 is not a node"), std::string::npos);
  EXPECT_NE(error_of([] { node_in_layout("0x0", 0); }).find("is not COUNTxSLOTS"), std::string::npos);
  EXPECT_NE(error_of([] { node_in_layout("999999999x0-1023", 0); }).find("more than 2^30"), std::string::npos);
  EXPECT_NE(error_of([] { make_node_plan("h", 0, {0, 1}, 5, 6, 1, "m", 29500, false); }).find("do not fit"),
            std::string::npos);
}

TEST(Plan, RanksLocalRanksAndEnvironment) {
  const auto pool = filter_resources(parse_hostfile("n0 slots=4\nn1 slots=4\n", "hf"), "n0:1,3@n1", "");
  const auto plan = make_plan(pool, "", 29501, /*gpu_slots=*/true);
  EXPECT_EQ(plan.world_size, 6);
  EXPECT_EQ(plan.master_addr, "n0");  // the first host when not given
  EXPECT_EQ(plan.nodes[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.nodes[1].ranks, (std::vector<int>{2, 3, 4, 5}));
  EXPECT_EQ(plan.nodes[1].local_ranks, (std::vector<int>{0, 1, 2, 3}));
  auto env = worker_env(plan, 0, 1, 2);
  EXPECT_EQ(env["RANK"], "1");
  EXPECT_EQ(env["LOCAL_RANK"], "1");
  EXPECT_EQ(env["WORLD_SIZE"], "6");
  EXPECT_EQ(env["LOCAL_SIZE"], "2");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(env["CROSS_RANK"], "0");
  EXPECT_EQ(env["CROSS_SIZE"], "2");
  EXPECT_EQ(env["MASTER_ADDR"], "n0");
  EXPECT_EQ(env["MASTER_PORT"], "29501");
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "1,3");  // the selected GPUs; LOCAL_RANK indexes them
  EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "2");
  env = worker_env(plan, 1, 3, 0);
  EXPECT_EQ(env["RANK"], "5");
  EXPECT_EQ(env["CROSS_RANK"], "1");
  EXPECT_EQ(env["GROUP_RANK"], "1");
  const auto cpu = make_plan(pool, "10.1.1.1", 29500, false);
  EXPECT_EQ(cpu.master_addr, "10.1.1.1");
  EXPECT_EQ(worker_env(cpu, 0, 0, 0).count("CUDA_VISIBLE_DEVICES"), 0u);
  EXPECT_EQ(make_plan({{"localhost", {0}}}, "", 29500, false).master_addr, "127.0.0.1");
  const auto j = plan_to_json(plan);
  EXPECT_EQ(j["hosts"][1]["ranks"], nlohmann::json({2, 3, 4, 5}));
  EXPECT_NE(error_of([&] { make_plan(pool, "", 70000, false); }).find("--master_port 70000"), std::string::npos);
}

TEST(EnvFile, SkipsBlanksAndCommentsAndRejectsGarbage) {
  const auto env = parse_env_file("\n# comment\nNCCL_DEBUG=INFO\n\n  export A_B = \"x y\"\nEMPTY=\nNCCL_DEBUG=WARN\n", "f");
  ASSERT_EQ(env.size(), 3u);
  EXPECT_EQ(env[0], (std::pair<std::string, std::string>{"NCCL_DEBUG", "WARN"}));
  EXPECT_EQ(env[1], (std::pair<std::string, std::string>{"A_B", "x y"}));
  EXPECT_EQ(env[2], (std::pair<std::string, std::string>{"EMPTY", ""}));
  EXPECT_NE(error_of([] { parse_env_file("A=1\nnot a pair\n", ".deepspeed_env"); }).find(".deepspeed_env:2: expected KEY=VALUE"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_env_file("1A=1\n", "f"); }).find("f:1"), std::string::npos);
}

LaunchOptions options(std::vector<std::string> program) {
  LaunchOptions o;
  o.program = std::move(program);
  return o;
}

TEST(Runners, WorkerAndNodeCommands) {
  auto o = options({"train_bert", "--config", "c.json"});
  EXPECT_EQ(worker_argv(o, 3), (Argv{"train_bert", "--config", "c.json", "--local_rank=3"}));
  o.no_local_rank = true;
  EXPECT_EQ(worker_argv(o, 3), (Argv{"train_bert", "--config", "c.json"}));
  const auto plan = make_plan(decode_pool("h1:0,1@h2:1"), "", 29500, true);
  o.log_dir = "logs";
  EXPECT_EQ(join_command(node_launcher_argv(o, plan, 1, "/opt/bin/launch")),
            "/opt/bin/launch --node_host h2 --node_rank 1 --node_slots 1 --rank_offset 2 --world_size 3 "
            "--num_nodes_total 2 --master_addr h1 --master_port 29500 --slot_type auto --term_timeout 5.000000 "
            "--no_local_rank --log_dir logs -- train_bert --config c.json");
  EXPECT_EQ(join_command(pdsh_node_launcher_argv(o, plan, "/opt/bin/launch")),
            "/opt/bin/launch --slot_layout 1x0-1@1x1 --node_rank %n --master_addr h1 --master_port 29500 "
            "--slot_type auto --term_timeout 5.000000 --no_local_rank --log_dir logs -- train_bert --config c.json");
  // Linear in the hosts: a node's command is as long with 10,000 hosts as with 2 (but digits).
  ResourcePool big;
  for (int i = 0; i < 10000; ++i) big.push_back({"h" + std::to_string(i + 1), {0}});
  const auto big_plan = make_plan(big, "h1", 29500, true);
  EXPECT_LE(join_command(node_launcher_argv(o, big_plan, 1, "/opt/bin/launch")).size(),
            join_command(node_launcher_argv(o, plan, 1, "/opt/bin/launch")).size() + 16);
  EXPECT_EQ(join_command(pdsh_node_launcher_argv(o, big_plan, "/opt/bin/launch")).find("--slot_layout 10000x0 "),
            std::string("/opt/bin/launch ").size());
  EXPECT_EQ(remote_shell_command("/my dir", {{"NCCL_DEBUG", "INFO"}}, {"a", "b c"}),
            "cd '/my dir' && exec env NCCL_DEBUG=INFO a 'b c'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
}

TEST(Runners, PdshSshMpirunSrun) {
  auto o = options({"train_bert", "--config", "c.json"});
  o.launcher_args = "-l  me";
  const auto plan = make_plan(decode_pool("h1:0,1@h2:0,1"), "", 29500, false);
  EXPECT_EQ(join_command(pdsh_argv(o, plan, "CMD")), "pdsh -S -f 1024 -w h1,h2 -l me CMD");
  EXPECT_EQ(join_command(ssh_argv(o, "h2", "CMD")), "ssh -l me h2 CMD");
  o.launcher_args = "--bind-to none";
  const auto mpi = join_command(mpirun_argv(o, plan, {{"NCCL_DEBUG", "INFO"}}, "/tmp/hf"));
  EXPECT_NE(mpi.find("mpirun -n 4 -hostfile /tmp/hf"), std::string::npos) << mpi;
  EXPECT_NE(mpi.find("-x MASTER_ADDR=h1 -x MASTER_PORT=29500 -x NCCL_DEBUG=INFO --bind-to none train_bert --config c.json"),
            std::string::npos)
      << mpi;
  EXPECT_EQ(mpirun_hostfile(plan), "h1 slots=2\nh2 slots=2\n");
  o.launcher_args = "";
  EXPECT_EQ(join_command(srun_argv(o, plan, {{"A", "1"}})),
            "srun -n 4 --nodelist h1,h2 --ntasks-per-node 2 --export=ALL,MASTER_ADDR=h1,MASTER_PORT=29500,A=1 "
            "train_bert --config c.json");
  const auto sparse = make_plan(decode_pool("h1:1,3"), "", 29500, true);
  EXPECT_NE(error_of([&] { mpirun_argv(o, sparse, {}, "f"); }).find("selects slot 1 at position 0"), std::string::npos);
  const auto uneven = make_plan(decode_pool("h1:0,1@h2:0"), "", 29500, false);
  EXPECT_NE(error_of([&] { srun_argv(o, uneven, {}); }).find("same number of slots"), std::string::npos);
}

TEST(Runners, RemoteExportsTakeTheLaunchersPrefixedVariablesThenTheEnvFile) {
  ::setenv("ASAN_OPTIONS", "fast_unwind_on_malloc=0", 1);
  ::setenv("NCCL_PT_TEST", "1", 1);
  ::setenv("PT_TEST_PRIVATE", "secret", 1);
  ::setenv("UCX_PT_TEST", "from env", 1);
  const auto out = remote_exports({{"UCX_PT_TEST", "from file"}, {"A_B", "x"}});
  ::unsetenv("ASAN_OPTIONS");
  ::unsetenv("NCCL_PT_TEST");
  ::unsetenv("PT_TEST_PRIVATE");
  ::unsetenv("UCX_PT_TEST");
  auto value = [&](const std::string& k) -> std::string {
    for (const auto& [key, v] : out)
      if (key == k) return v;
    return "<absent>";
  };
  EXPECT_EQ(value("ASAN_OPTIONS"), "fast_unwind_on_malloc=0");
  EXPECT_EQ(value("NCCL_PT_TEST"), "1");
  EXPECT_EQ(value("PT_TEST_PRIVATE"), "<absent>");  // only the listed prefixes travel
  EXPECT_EQ(value("UCX_PT_TEST"), "from file");     // .deepspeed_env wins
  EXPECT_EQ(value("A_B"), "x");
  EXPECT_NE(value("PATH"), "<absent>");
}

TEST(Runners, FindInPath) {
  EXPECT_FALSE(find_in_path("sh").empty());
  EXPECT_TRUE(find_in_path("no-such-binary-polytrain").empty());
}

}  // namespace

// ---- OpenBLAS's kernel by CPU features (src/common/blas_kernel.h) on recorded /proc/cpuinfo ----

namespace blas_cases {

CpuFeatures sample(const std::string& file) {
  std::ifstream in(std::string(POLYTRAIN_SOURCE_DIR) + "/tests/data/cpuinfo/" + file);
  EXPECT_TRUE(in.good()) << file;
  std::stringstream ss;
  ss << in.rdbuf();
  return cpu_features_from_cpuinfo(ss.str());
}

}  // namespace blas_cases

TEST(BlasKernel, ParsesTheFirstProcessorBlock) {
  const auto spr = blas_cases::sample("intel_xeon_6_207_amx.txt");
  EXPECT_EQ(spr.vendor, "GenuineIntel");
  EXPECT_EQ(spr.family, 6);
  EXPECT_EQ(spr.model, 207);
  EXPECT_TRUE(spr.sse3 && spr.avx && spr.avx2 && spr.fma && spr.avx512 && spr.avx512_bf16 && spr.amx_bf16);
  EXPECT_EQ(describe_cpu(spr), "Intel family 6 model 207, AVX-512, AVX512-BF16, AMX-BF16");
  const auto zen3 = blas_cases::sample("amd_epyc_zen3_25_1.txt");  // the second block says "fpu" only
  EXPECT_TRUE(zen3.avx2 && zen3.fma);
  EXPECT_FALSE(zen3.avx512 || zen3.avx512_bf16 || zen3.amx_bf16);
  EXPECT_EQ(describe_cpu(zen3), "AMD family 25 model 1, AVX2+FMA");
  const auto zen4 = blas_cases::sample("amd_epyc_zen4_25_17.txt");
  EXPECT_TRUE(zen4.avx512 && zen4.avx512_bf16);
  EXPECT_FALSE(zen4.amx_bf16);
  const auto zen5 = blas_cases::sample("amd_epyc_zen5_26_2.txt");  // recorded on a development VM
  EXPECT_EQ(describe_cpu(zen5), "AMD family 26 model 2, AVX-512, AVX512-BF16");
  const auto bdw = blas_cases::sample("intel_xeon_broadwell_avx2_6_79.txt");
  EXPECT_TRUE(bdw.avx2 && bdw.fma && !bdw.avx512);
  // AVX-512 needs all five subsets SkylakeX's kernels use; F alone is not enough.
  EXPECT_FALSE(cpu_features_from_cpuinfo("processor : 0\nflags : pni avx avx2 fma avx512f\n").avx512);
  EXPECT_EQ(cpu_features_from_cpuinfo("").family, -1);
}

struct BlasCase {
  const char* sample;
  const char* openblas_pick;
  const char* user_env;  // OPENBLAS_CORETYPE, null when unset
  const char* want;      // the coretype chosen, "" to leave OpenBLAS's pick
  const char* reason;    // a part of the reason
};
void PrintTo(const BlasCase& c, std::ostream* os) { *os << c.sample << " / " << c.openblas_pick; }

class BlasKernelChoices : public ::testing::TestWithParam<BlasCase> {};

TEST_P(BlasKernelChoices, ChoosesByFeaturesOnlyWhenOpenBlasFellBack) {
  const auto& c = GetParam();
  const auto choice = choose_openblas_core(blas_cases::sample(c.sample), c.openblas_pick, c.user_env);
  EXPECT_EQ(choice.coretype, c.want);
  EXPECT_NE(choice.reason.find(c.reason), std::string::npos) << choice.reason;
}

INSTANTIATE_TEST_SUITE_P(
    Samples, BlasKernelChoices,
    ::testing::Values(
        // The Xeon OpenBLAS 0.3.21 does not know: Prescott's SSE3 kernels -> SkylakeX.
        BlasCase{"intel_xeon_6_207_amx.txt", "Prescott", nullptr, "SkylakeX",
                 "chosen by polytrain: OpenBLAS picked Prescott for Intel family 6 model 207, AVX-512"},
        BlasCase{"intel_xeon_6_207_amx.txt", "Prescott", "", "SkylakeX", "picked Prescott"},  // empty = unset
        // A user's OPENBLAS_CORETYPE wins, whatever it says.
        BlasCase{"intel_xeon_6_207_amx.txt", "Prescott", "Haswell", "", "OPENBLAS_CORETYPE=Haswell from the environment"},
        // ... and a core older than the CPU is named as such (AVX2 kernels on an AVX-512 CPU).
        BlasCase{"amd_epyc_zen5_26_2.txt", "Cooperlake", "Haswell", "",
                 "OPENBLAS_CORETYPE=Haswell from the environment, older than this CPU (AVX-512: SkylakeX would be faster)"},
        BlasCase{"amd_epyc_zen5_26_2.txt", "Cooperlake", "Cooperlake", "", "OPENBLAS_CORETYPE=Cooperlake from the environment"},
        // The model OpenBLAS knows: its own pick stays.
        BlasCase{"intel_xeon_6_167_amx.txt", "SkylakeX", nullptr, "", "OpenBLAS's own pick"},
        BlasCase{"intel_xeon_6_167_amx.txt", "Cooperlake", nullptr, "", "OpenBLAS's own pick"},
        // Zen 3 and Zen 4: OpenBLAS's Zen (or Haswell) kernels are AVX2 ones: kept, even where the
        // CPU has AVX-512 (no measurement says SkylakeX's would be faster there).
        BlasCase{"amd_epyc_zen3_25_1.txt", "Zen", nullptr, "", "OpenBLAS's own pick for AMD family 25 model 1"},
        BlasCase{"amd_epyc_zen4_25_17.txt", "Zen", nullptr, "", "OpenBLAS's own pick"},
        BlasCase{"amd_epyc_zen4_25_17.txt", "Haswell", nullptr, "", "OpenBLAS's own pick"},
        // Zen 5: OpenBLAS 0.3.21 picks Cooperlake (AVX-512) by its features: kept.
        BlasCase{"amd_epyc_zen5_26_2.txt", "Cooperlake", nullptr, "", "OpenBLAS's own pick for AMD family 26 model 2"},
        BlasCase{"amd_epyc_zen5_26_2.txt", "Prescott", nullptr, "SkylakeX", "picked Prescott"},
        // A fall-back on them is corrected to their best: SkylakeX with AVX-512, else Haswell.
        BlasCase{"amd_epyc_zen4_25_17.txt", "Barcelona", nullptr, "SkylakeX", "picked Barcelona"},
        BlasCase{"amd_epyc_zen3_25_1.txt", "Prescott", nullptr, "Haswell", "picked Prescott"},
        BlasCase{"intel_xeon_broadwell_avx2_6_79.txt", "Nehalem", nullptr, "Haswell", "AVX2+FMA"},
        BlasCase{"intel_xeon_broadwell_avx2_6_79.txt", "Sandybridge", nullptr, "Haswell", "picked Sandybridge"},
        BlasCase{"intel_xeon_broadwell_avx2_6_79.txt", "Haswell", nullptr, "", "OpenBLAS's own pick"},
        // Not OpenBLAS (netlib, BLIS, MKL): nothing to choose; a core name nobody knows: left alone.
        BlasCase{"intel_xeon_6_207_amx.txt", "", nullptr, "", ""},
        BlasCase{"intel_xeon_6_207_amx.txt", "Graniterapids", nullptr, "", "a core this choice does not know"}));

// A user's core as new as the CPU's best, or one this choice does not know, is not called older.
TEST(BlasKernel, AUsersCoreIsCalledOlderOnlyWhenItIs) {
  const auto zen5 = blas_cases::sample("amd_epyc_zen5_26_2.txt");
  for (const char* core : {"Cooperlake", "SkylakeX", "Graniterapids"})
    EXPECT_EQ(choose_openblas_core(zen5, "Cooperlake", core).reason.find("older"), std::string::npos) << core;
  EXPECT_EQ(choose_openblas_core(blas_cases::sample("amd_epyc_zen3_25_1.txt"), "Zen", "Haswell").reason.find("older"),
            std::string::npos);
  EXPECT_NE(choose_openblas_core(blas_cases::sample("amd_epyc_zen3_25_1.txt"), "Zen", "Prescott").reason.find(
                "older than this CPU (AVX2+FMA: Haswell would be faster)"),
            std::string::npos);
}

// The choice travels as OPENBLAS_CORETYPE plus POLYTRAIN_BLAS_KERNEL="CORE|reason".
TEST(BlasKernel, TheChoiceTravelsWithItsReason) {
  const auto c = choose_openblas_core(blas_cases::sample("intel_xeon_6_207_amx.txt"), "Prescott", nullptr);
  EXPECT_EQ(blas_kernel_env_value(c), "SkylakeX|" + c.reason);
}

// bf16 autocast on a CPU: kept where the CPU multiplies bf16 natively, fp32 otherwise.
TEST(BlasKernel, Bf16IsKeptOnlyWhereTheCpuHasNativeBf16) {
  for (const char* native : {"intel_xeon_6_207_amx.txt", "intel_xeon_6_167_amx.txt", "amd_epyc_zen4_25_17.txt",
                             "amd_epyc_zen5_26_2.txt"})
    EXPECT_EQ(cpu_bf16_fallback_reason(blas_cases::sample(native), nullptr), "") << native;
  const auto zen3 = cpu_bf16_fallback_reason(blas_cases::sample("amd_epyc_zen3_25_1.txt"), nullptr);
  EXPECT_NE(zen3.find("has neither AVX512-BF16 nor AMX-BF16, so bf16 matmuls would be unsupported by oneDNN"),
            std::string::npos)
      << zen3;
  EXPECT_NE(cpu_bf16_fallback_reason(blas_cases::sample("intel_xeon_broadwell_avx2_6_79.txt"), nullptr), "");
  const auto skx = cpu_bf16_fallback_reason(
      cpu_features_from_cpuinfo("processor : 0\nflags : pni avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl\n"),
      nullptr);
  EXPECT_NE(skx.find("emulated"), std::string::npos) << skx;
  EXPECT_EQ(cpu_bf16_fallback_reason(blas_cases::sample("amd_epyc_zen3_25_1.txt"), "1"), "");  // kept on request
  EXPECT_EQ(cpu_bf16_fallback_reason(blas_cases::sample("intel_xeon_6_207_amx.txt"), "0"), "POLYTRAIN_CPU_BF16=0");
}
