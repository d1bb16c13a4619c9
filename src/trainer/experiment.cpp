#include "polytrain/trainer/experiment.h"

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <random>

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
}  // namespace

std::string make_uuid4() {
  std::random_device rd;
  unsigned char b[16];
  for (auto& x : b) x = static_cast<unsigned char>(rd());
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  char s[37];
  std::snprintf(s, sizeof s, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return s;
}

std::string create_experiment_dir(const TrainerOptions& opts, const nlohmann::json& hparams) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y.%m.%d.%H.%M.%S", &tm);
  const fs::path dir =
      fs::path(opts.experiments_dir) / (opts.exp_type + "." + stamp + "." + make_uuid4()) / opts.experiment_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  PT_INPUT_CHECK(!ec, "trainer.experiments_dir: cannot create ", dir.string(), ": ", ec.message());
  atomic_write_file((dir / "hparams.json").string(), hparams.dump(2) + "\n");
  atomic_write_file((dir / "githash.log").string(),
                    git_output("rev-parse HEAD", "not a git checkout\n"));
  atomic_write_file((dir / "gitdiff.log").string(), git_output("diff HEAD", ""));
  return dir.string();
}

}  // namespace polytrain
