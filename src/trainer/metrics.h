// Metric sinks of one run: metrics.jsonl (always), TensorBoard events (always, under
// tensorboard/), CSV files (csv_monitor), and the console: a log line every log_interval and a
// progress bar on a terminal. Only rank 0 writes; what to log is the Trainer's business.
#pragma once

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace polytrain {

class TensorBoardWriter;

/// Where the TensorBoard events of a run go: tensorboard.output_path/job_name when that block
/// is enabled, else <experiment_dir>/tensorboard.
std::string tensorboard_dir(const Config& cfg, const std::string& experiment_dir);

class MetricsLogger {
 public:
  /// enabled=false (ranks other than 0) makes every call a no-op.
  MetricsLogger(const Config& cfg, const std::string& experiment_dir, bool enabled);
  ~MetricsLogger();

  /// One JSON record into metrics.jsonl; numeric fields also go to TensorBoard under
  /// `prefix + key` and to CSV when csv_monitor is enabled.
  void record(int64_t step, const nlohmann::json& fields, const std::string& prefix);

  /// One JSON record into metrics.jsonl only, as it is (the run's summary).
  void note(const nlohmann::json& record);

  /// Console line (clears the progress bar first).
  void print_line(const std::string& line);
  /// Redraws the progress bar (terminal only).
  void progress(int64_t step, int64_t total, double loss, double ms_per_step);
  void finish();

 private:
  bool enabled_;
  bool tty_;
  bool bar_shown_ = false;
  bool progress_bar_;
  std::FILE* jsonl_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::string csv_dir_;
  std::map<std::string, std::FILE*> csv_;
};

}  // namespace polytrain
