// Every command of docs/workflows.md runs as written. Each ```sh block there is one workflow
// and one test here: its lines run in order, from a scratch folder laid out like the checkout
// (build/, configs/, scripts/, hostfiles/ and .cache/assets as links), each shortened the same
// way: a `--max_steps K` given becomes `--max_steps 2` (0 stays 0: nothing to train), and a
// command without one gets `--max_steps 4` at its end (so a resume after a 2-step run has 2
// steps left). A command must exit 0, print no `error:` line and end with `done: ...`.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "helpers/process.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace fs = std::filesystem;
using polytrain::testing::asset_cache;
using polytrain::testing::run_command;
using polytrain::testing::TempDir;

namespace {

struct Workflow {
  std::string heading;
  std::vector<std::string> commands;
};

// gtest names a parameter by this (not by its bytes) in test lists and failures.
void PrintTo(const Workflow& w, std::ostream* os) { *os << w.heading; }

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// A command line without its trailing `# comment` (the docs' commands quote no '#').
std::string without_comment(const std::string& line) {
  const auto hash = line.find(" #");
  return trim(hash == std::string::npos ? line : line.substr(0, hash));
}

std::vector<Workflow> read_workflows() {
  std::ifstream in(fs::path(POLYTRAIN_SOURCE_DIR) / "docs/workflows.md");
  std::vector<Workflow> out;
  std::string heading, line;
  bool in_block = false;
  while (std::getline(in, line)) {
    if (!in_block && line.rfind("#", 0) == 0) heading = trim(line.substr(line.find(' ') + 1));
    if (line.rfind("```", 0) == 0) {
      in_block = !in_block && line == "```sh";
      if (in_block) out.push_back({heading, {}});
      continue;
    }
    if (!in_block) continue;
    const std::string cmd = without_comment(line);
    if (!cmd.empty() && cmd[0] != '#') out.back().commands.push_back(cmd);
  }
  return out;
}

// The shortened command (see the file comment).
std::string shortened(const std::string& cmd) {
  static const std::regex positive("--max_steps [1-9][0-9]*");
  if (cmd.find("--max_steps ") != std::string::npos) return std::regex_replace(cmd, positive, "--max_steps 2");
  return cmd + " --max_steps 4";
}

std::string test_name(const std::string& heading, size_t index) {
  std::string name;
  for (char c : heading)
    if (std::isalnum(static_cast<unsigned char>(c))) name += c;
  return name.empty() ? "Block" + std::to_string(index) : name;
}

class DocsWorkflow : public ::testing::TestWithParam<Workflow> {};

TEST_P(DocsWorkflow, RunsAsWritten) {
  const Workflow& w = GetParam();
  ASSERT_FALSE(w.commands.empty()) << "an empty ```sh block under '" << w.heading << "'";
  TempDir dir("pt_docs");
  const fs::path src(POLYTRAIN_SOURCE_DIR);
  fs::create_symlink(POLYTRAIN_BINARY_DIR, dir.path / "build");
  for (const char* sub : {"configs", "scripts", "hostfiles"}) fs::create_symlink(src / sub, dir.path / sub);
  fs::create_directories(dir.path / ".cache");
  fs::create_symlink(asset_cache(), dir.path / ".cache/assets");
  for (size_t i = 0; i < w.commands.size(); ++i) {
    const std::string run = shortened(w.commands[i]);
    std::ofstream(dir.path / "command.sh") << run << "\n";
    std::string out;
    // Each command has its own deadline; `timeout` ends it (and launch its workers) by signal.
    // OUT: where scripts/swarm_demo.sh keeps its logs (else a temp folder of its own, left behind).
    const int code = run_command("cd '" + dir.str() + "' && OUT='" + dir.str("out" + std::to_string(i)) +
                                     "' timeout -k 10 240 bash command.sh 2>&1",
                                 &out);
    EXPECT_EQ(code, 0) << "docs/workflows.md, '" << w.heading << "': " << run << "\n" << out;
    EXPECT_EQ(("\n" + out).find("\nerror: "), std::string::npos) << run << "\n" << out;
    // It trained: a program's last line, or the swarm script's (which prints the monitor's).
    EXPECT_TRUE(out.find("done: ") != std::string::npos || out.find("swarm finished (exit 0)") != std::string::npos)
        << run << "\n" << out;
    if (code != 0) return;  // the next command of the workflow needs this one's output
  }
}

INSTANTIATE_TEST_SUITE_P(Docs, DocsWorkflow, ::testing::ValuesIn(read_workflows()),
                         [](const ::testing::TestParamInfo<Workflow>& info) {
                           return test_name(info.param.heading, info.index);
                         });

TEST(DocsWorkflows, TheFileHasTheWorkflowsTheDocsPromise) {
  const auto all = read_workflows();
  std::string text;
  for (const auto& w : all)
    for (const auto& c : w.commands) text += c + "\n";
  // One command per workflow, for GPT-2 and for BERT.
  for (const char* program : {"train_bert", "train_gpt2"})
    for (const char* what : {"_ddp.json", "zero2_offload.json", "tp2.json", "tp2_zero2.json", "hivemind.json",
                             "--load_dir", "--save_hf"}) {
      bool found = false;
      std::istringstream lines(text);
      for (std::string line; std::getline(lines, line);)
        found = found || (line.find(program) != std::string::npos && line.find(what) != std::string::npos);
      EXPECT_TRUE(found) << "no " << program << " command with " << what << " in docs/workflows.md";
    }
  EXPECT_EQ(shortened("a --max_steps 100 b"), "a --max_steps 2 b");
  EXPECT_EQ(shortened("a --max_steps 0"), "a --max_steps 0");
  EXPECT_EQ(shortened("a"), "a --max_steps 4");
}

}  // namespace
