#include "polytrain/trainer/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "polytrain/common/error.h"
#include "polytrain/trainer/tensorboard.h"

namespace polytrain {

namespace {
// Workers started by `launch` write into a pipe; the launcher sets POLYTRAIN_TTY=1 when its
// own stderr is a terminal and relays '\r' updates as they come, so the bar still works.
bool launcher_tty() {
  const char* v = std::getenv("POLYTRAIN_TTY");
  return v && std::string(v) == "1";
}
}  // namespace

namespace fs = std::filesystem;

std::string tensorboard_dir(const Config& cfg, const std::string& experiment_dir) {
  if (cfg.tensorboard.enabled && !cfg.tensorboard.output_path.empty())
    return (fs::path(cfg.tensorboard.output_path) / cfg.tensorboard.job_name).string();
  return (fs::path(experiment_dir) / "tensorboard").string();
}

MetricsLogger::MetricsLogger(const Config& cfg, const std::string& experiment_dir, bool enabled)
    : enabled_(enabled), tty_(::isatty(STDERR_FILENO) != 0 || launcher_tty()), progress_bar_(cfg.trainer.progress_bar) {
  if (!enabled_) return;
  const std::string jsonl = (fs::path(experiment_dir) / "metrics.jsonl").string();
  jsonl_ = std::fopen(jsonl.c_str(), "a");
  PT_INPUT_CHECK(jsonl_, "cannot open ", jsonl, " for writing");
  tb_ = std::make_unique<TensorBoardWriter>(tensorboard_dir(cfg, experiment_dir));
  if (cfg.csv_monitor.enabled) {
    csv_dir_ = cfg.csv_monitor.output_path.empty()
                   ? (fs::path(experiment_dir) / "csv").string()
                   : (fs::path(cfg.csv_monitor.output_path) / cfg.csv_monitor.job_name).string();
    fs::create_directories(csv_dir_);
  }
}

MetricsLogger::~MetricsLogger() {
  if (jsonl_) std::fclose(jsonl_);
  for (auto& [name, f] : csv_) std::fclose(f);
}

void MetricsLogger::record(int64_t step, const nlohmann::json& fields, const std::string& prefix) {
  if (!enabled_) return;
  nlohmann::json rec = {{"step", step}};
  rec.update(fields);
  std::fprintf(jsonl_, "%s\n", rec.dump().c_str());
  std::fflush(jsonl_);
  for (const auto& [key, value] : fields.items()) {
    if (!value.is_number()) continue;
    const std::string tag = prefix + key;
    tb_->add_scalar(tag, value.get<double>(), step);
    if (!csv_dir_.empty()) {
      auto& f = csv_[tag];
      if (!f) {
        std::string name = tag;
        for (char& c : name)
          if (c == '/') c = '_';
        const std::string path = (fs::path(csv_dir_) / (name + ".csv")).string();
        const bool fresh = !fs::exists(path);
        f = std::fopen(path.c_str(), "a");
        PT_INPUT_CHECK(f, "cannot open ", path, " for writing");
        if (fresh) std::fprintf(f, "step,%s\n", tag.c_str());
      }
      std::fprintf(f, "%lld,%.9g\n", static_cast<long long>(step), value.get<double>());
      std::fflush(f);
    }
  }
  tb_->flush();
}

void MetricsLogger::note(const nlohmann::json& record) {
  if (!enabled_) return;
  std::fprintf(jsonl_, "%s\n", record.dump().c_str());
  std::fflush(jsonl_);
}

void MetricsLogger::print_line(const std::string& line) {
  if (!enabled_) return;
  if (bar_shown_) {
    std::fprintf(stderr, "\r\033[K");
    bar_shown_ = false;
  }
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

void MetricsLogger::progress(int64_t step, int64_t total, double loss, double ms_per_step) {
  if (!enabled_ || !tty_ || !progress_bar_ || total <= 0) return;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * step / total);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  const double eta_s = ms_per_step * static_cast<double>(total - step) / 1000.0;
  std::fprintf(stderr, "\r\033[K[%s] %lld/%lld loss %.4f %.1f ms/step eta %.0fs", bar.c_str(),
               static_cast<long long>(step), static_cast<long long>(total), loss, ms_per_step, eta_s);
  std::fflush(stderr);
  bar_shown_ = true;
}

void MetricsLogger::finish() {
  if (bar_shown_) std::fprintf(stderr, "\r\033[K");
  bar_shown_ = false;
  if (tb_) tb_->flush();
}

}  // namespace polytrain
