#include "polytrain/trainer/experiment.h"

#include <cstdio>
#include <ctime>
#include <filesystem>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {
// Runs a git command in the current directory; its stdout, or `fallback` when git fails.
std::string git_output(const std::string& args, const std::string& fallback) {
  std::string cmd = "git " + args + " 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return fallback;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  return ::pclose(p) == 0 ? out : fallback;
}

std::string local_stamp() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y.%m.%d.%H.%M.%S", &tm);
  return stamp;
}

// The stamped folder, claimed with mkdir (which fails on an existing name, so two runs started
// in the same second, even from different processes, never share one): a counter only then.
fs::path claim_run_folder(const TrainerOptions& opts) {
  const fs::path root(opts.experiments_dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  PT_INPUT_CHECK(!ec, "trainer.experiments_dir: cannot create ", root.string(), ": ", ec.message());
  const std::string base = opts.exp_type + "." + local_stamp() + "." + opts.experiment_name;
  for (int n = 1; n < 1000; ++n) {
    const fs::path dir = root / (n == 1 ? base : base + "." + std::to_string(n));
    if (fs::create_directory(dir, ec)) return dir;
    PT_INPUT_CHECK(!ec, "trainer.experiments_dir: cannot create ", dir.string(), ": ", ec.message());
  }
  throw InputError("trainer.experiments_dir: 999 folders named " + (root / base).string() + "* exist already");
}

bool is_experiment_dir(const fs::path& dir) { return fs::exists(dir / "hparams.json"); }

}  // namespace

std::string create_experiment_dir(const TrainerOptions& opts, const nlohmann::json& hparams) {
  const fs::path dir = claim_run_folder(opts) / opts.experiment_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  PT_INPUT_CHECK(!ec, "trainer.experiments_dir: cannot create ", dir.string(), ": ", ec.message());
  atomic_write_file((dir / "hparams.json").string(), hparams.dump(2) + "\n");
  atomic_write_file((dir / "githash.log").string(), git_output("rev-parse HEAD", "not a git checkout\n"));
  atomic_write_file((dir / "gitdiff.log").string(), git_output("diff HEAD", ""));
  return dir.string();
}

std::string continued_experiment_dir(const TrainerOptions& opts, const std::string& recorded) {
  if (opts.load_dir.empty()) return "";
  fs::path dir = recorded;
  if (dir.empty()) {
    const fs::path load = fs::weakly_canonical(opts.load_dir);
    if (load.filename() == "checkpoints") dir = load.parent_path();
  }
  if (dir.empty() || !is_experiment_dir(dir) || dir.filename() != opts.experiment_name) return "";
  return dir.string();
}

void remove_experiment_dir(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  fs::remove_all(fs::path(dir).parent_path(), ec);
}

}  // namespace polytrain
