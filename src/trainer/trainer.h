// Trainer: the one training loop for every env_type (FlagAI's Trainer in C++). Users subclass
// it and override forward_step; the loop never branches on env_type, it talks to a Backend
// (parallel/backend.h). Checkpoint format lives in checkpoint.h, metric sinks in metrics.h,
// the run folder in experiment.h.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "polytrain/common/config.h"
#include "polytrain/data/batch.h"
#include "polytrain/data/batch_source.h"
#include "polytrain/models/model_output.h"
#include "polytrain/optim/loss_scaler.h"

namespace polytrain {

class Backend;
class ElasticGroup;
class InterruptNote;
class LrSchedule;
class MetricsLogger;
class SampleStream;
struct StepRequest;
struct StepResult;

/// What train() did.
struct TrainResult {
  int64_t steps = 0;             ///< optimizer steps done in total (resumed ones included)
  int64_t skipped_steps = 0;     ///< updates skipped for non-finite gradients (fp16 overflows included)
  double loss_scale = 1.0;       ///< the fp16 loss scale at the end (1 without fp16)
  std::vector<double> losses;    ///< global mean loss of each step run in this call
  double best_eval_loss = 0.0;   ///< NaN when no evaluation ran
  std::string experiment_dir;    ///< this run's folder
  std::string save_dir;          ///< where checkpoints went

  /// The examples' last line: "done: N steps, final loss L, best eval loss E, experiment D,
  /// checkpoints C"; a run that had no step left to take says so instead of a loss.
  std::string done_line() const;
};

struct EvalResult {
  double loss = 0.0;
  double perplexity = 0.0;
  int64_t batches = 0;
};

class Trainer {
 public:
  /// Seeds torch's RNG and sets its thread count: construct the Trainer before the model so the
  /// model's initial weights depend only on trainer.seed.
  explicit Trainer(Config cfg);
  virtual ~Trainer();

  /// One micro-batch: run the model, return the loss (and optionally logits, hidden states).
  virtual ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) = 0;

  /// Trains model on train_data (evaluating on eval_data when given) for trainer.max_steps
  /// optimizer steps, or trainer.epochs epochs when max_steps is 0. Resumes from
  /// trainer.load_dir when set.
  TrainResult train(std::shared_ptr<torch::nn::Module> model, const BatchSource& train_data,
                    const BatchSource* eval_data = nullptr);

  /// Mean loss over the first data.eval_batches micro-batches of eval_data (all when 0).
  /// Usable before train(): the model then runs where the backend puts it.
  EvalResult evaluate(torch::nn::Module& model, const BatchSource& eval_data);

  /// Runs on `backend` instead of the one trainer.env_type names (tests, custom backends).
  /// Call before train() or evaluate().
  void set_backend(std::unique_ptr<Backend> backend);

  const Config& config() const { return cfg_; }

 protected:
  Config cfg_;

 private:
  Backend& backend();
  void setup(const std::shared_ptr<torch::nn::Module>& model, const BatchSource& train_data);
  void open_experiment();
  void print_run_summary(int64_t parameters);
  TrainResult run_loop(torch::nn::Module& model, const BatchSource& train_data, const BatchSource* eval_data);
  void resume(torch::nn::Module& model, SampleStream& stream);
  StepResult train_step(torch::nn::Module& model, const BatchSource& data, SampleStream& stream,
                        const StepRequest& request, double* loss);
  void record_step(const StepResult& r, double loss, double lr);
  void check_fault_tolerance();
  StepResult step_surviving_failures(torch::nn::Module& model, const BatchSource& data, SampleStream& stream,
                                     StepRequest& request, double* loss);
  SampleStream& member_stream(int64_t member, SampleStream& own, int64_t dataset_size);
  void surviving(const std::string& what, const std::function<void()>& work);
  bool admit_replacements(SampleStream& stream);
  std::string live_state(const SampleStream& stream) const;
  void load_live_state(const std::string& state, SampleStream& stream);
  void regroup_after(const std::string& why, std::chrono::steady_clock::time_point since, int64_t step,
                     const std::string& when, const std::string& redone);
  void run_eval_and_record(torch::nn::Module& model, const BatchSource& eval_data, const SampleStream& stream);
  void save(torch::nn::Module& model, const std::string& tag, const SampleStream& stream);

  std::unique_ptr<Backend> backend_;
  ElasticGroup* elastic_ = nullptr;  ///< the backend, with trainer.fault_tolerance
  /// Fault tolerance: the sample streams of lost members, whose micro-batches this rank runs.
  std::map<int64_t, std::unique_ptr<SampleStream>> member_streams_;
  /// Fault tolerance: replacements admitted whose live state is not sent yet, and since when.
  std::vector<int64_t> admitting_, admitting_members_;
  int64_t admitting_generation_ = 0;
  std::chrono::steady_clock::time_point admitting_since_;
  bool prepared_ = false;
  std::unique_ptr<MetricsLogger> metrics_;
  std::unique_ptr<LrSchedule> schedule_;
  std::optional<LossScaler> scaler_;  ///< fp16 only
  std::string experiment_dir_;
  bool experiment_created_ = false;  ///< experiment_dir_ is this run's own (not a resumed run's)
  std::string save_dir_;
  std::unique_ptr<InterruptNote> interrupt_;
  int64_t steps_run_ = 0;          ///< steps taken by this train() call
  int64_t tokens_per_sample_ = 0;  ///< input_ids length of a training sample (0: no input_ids)
  std::chrono::steady_clock::time_point started_;
  std::vector<std::string> saved_tags_;
  // Progress (saved in checkpoints):
  int64_t step_ = 0;           ///< optimizer steps taken (the backend's global step)
  int64_t applied_ = 0;        ///< updates applied: the LR schedule's step
  int64_t skipped_steps_ = 0;  ///< updates skipped for non-finite gradients
  double best_eval_loss_;
  std::optional<c10::ScalarType> autocast_;     ///< the forward's autocast type (fp16, bf16, amp O1)
  std::optional<c10::ScalarType> output_cast_;  ///< amp's cast of the model outputs (O2, O3)
  int64_t total_steps_ = 0;
  int64_t epoch_ = 0;          ///< epoch of the last samples read (logged)
  // Log interval accounting:
  int64_t interval_steps_ = 0;
  double interval_ms_[4] = {0, 0, 0, 0};  ///< wall, forward, backward, step
};

}  // namespace polytrain
