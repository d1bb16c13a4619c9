// One rank's stage of a pipeline (DeepSpeed's PipelineEngine, Megatron's pipeline schedules),
// as a part a data-parallel strategy composes with: the strategy (replicate, ZeRO-1/2) runs over
// the parameters this stage trains, over its dp group, and hands its backward to the schedule.
//
// The model's stage plan (models/pipeline_plan.h) is cut into P x V chunks (chunk g on stage
// g mod P); a stage keeps the parameters of its chunks and lets the others go. A parameter that
// chunks of several stages read (tied embeddings, ALBERT's shared layer, T5's shared embedding) is
// trained on the lowest of them (its primary) and mirrored on the others: after the step's
// backwards every mirror sends its gradient to the primary, which adds it through one more
// backward (so the strategy reduces it like any other), and after the update the primary sends
// the new values back (Megatron's embedding group, as a reduce and a broadcast).
//
// Activations travel as named tensors with a header (names, dtypes, shapes) per micro-batch, so
// sequence lengths may change from one micro-batch to the next; sends are non-blocking, receives
// wait with the communicator's timeout. Every stage reads the same micro-batches (token ids are
// cheap) so masks and labels need not travel.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "polytrain/common/config.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/parallel/backend.h"

namespace polytrain {

class Communicator;
class CommWork;

/// What the last step's schedule measured on this stage.
struct PipelineStepStats {
  double step_s = 0;         ///< the schedule's wall time (reads, forwards, backwards, waits)
  double compute_s = 0;      ///< forwards and backwards
  double wait_s = 0;         ///< blocked on a receive
  int64_t peak_in_flight = 0;          ///< most chunk forwards awaiting their backward
  int64_t peak_activation_bytes = 0;   ///< heap in use above the step's start, at its peak (tcmalloc's or glibc's count)
  double weight_s = 0;                 ///< ZB-H1: in W passes (part of compute_s)
  int64_t split_backwards = 0;         ///< ZB-H1: micro-batches whose backward ran as separate B and W passes
};

class PipelineStage {
 public:
  /// `pp_group`: this rank's pipeline, ordered by stage (not owned; outlives this). InputError
  /// when the schedule cannot run `micro_batches` per step (gradient_accumulation_steps).
  PipelineStage(Communicator& pp_group, const PipelineConfig& cfg, int64_t micro_batches, c10::Device device);
  ~PipelineStage();

  int64_t stage() const { return stage_; }
  int64_t stages() const { return stages_; }
  bool last() const { return stage_ == stages_ - 1; }

  /// Cuts `model` (whole, identical on every stage; already split by TP) into chunks and lets go
  /// of the parameters this stage does not read. InputError (one line) for a model without a stage
  /// plan, more chunks than layers, a partition that leaves a chunk empty, virtual_stages that do
  /// not divide the layers.
  void apply(torch::nn::Module& model);
  /// "stage 1 of 2: layers h.2 .. head (5 of 9), 1.2M parameters"
  std::string describe() const;
  /// Every stage's layers and the schedule, for the run's first lines: "pipeline: 1f1b, 4
  /// micro-batches per step, partition type:Gpt2Block | stage 0: embeddings .. h.1 | stage 1: ..."
  std::string layout() const;
  /// Whether this stage's optimizer trains `param` (it reads it and is its primary).
  bool trains(const std::string& param) const { return trained_.count(param) > 0; }
  /// Whether `param` was let go here (no layer of this stage reads it).
  bool dropped(const std::string& param) const { return dropped_.count(param) > 0; }
  /// Whether `param` is read here but trained on another stage.
  bool mirrors(const std::string& param) const { return mirror_of_.count(param) > 0; }

  using BackwardFn = std::function<void(const at::Tensor& loss, const MicroStep& m)>;
  /// One step: `micro_batches` micro-batches of `micro_size` samples through the schedule;
  /// `backward` is the strategy's (gradients accumulate; the strategy reduces them in its step).
  /// Then the mirrors' gradients reach their primaries.
  void run(MicroBatchRunner& runner, int64_t micro_batches, int64_t micro_size, const BackwardFn& backward);
  /// Evaluation: one micro-batch through every stage, no gradients; its loss on the last stage,
  /// undefined on the others.
  at::Tensor forward_only(const TensorMap& inputs);
  /// After the strategy's update: the primaries' new values to their mirrors (collective).
  void after_step();

  /// The last stage's `value` on every stage (collective).
  double from_last(double value);
  /// The sum of `value` over the stages (collective).
  double sum(double value);

  /// `state` (module_state) without the parameters this stage does not train (dropped, mirrored).
  NamedTensors own(const NamedTensors& state) const;
  /// Every stage's own() put together on stage 0 in the model's order (collective); the others
  /// get theirs back.
  NamedTensors gather(NamedTensors own_state);
  /// This stage's part of a whole state: the dropped parameters as empty tensors.
  NamedTensors select(const NamedTensors& whole) const;
  /// The whole model on every stage again (collective; after training, for --save_hf).
  void release(torch::nn::Module& model);

  const PipelineStepStats& stats() const { return stats_; }

 private:
  struct Chunk {
    std::vector<const PipeLayer*> layers;
  };
  int64_t global_chunk(int64_t local) const { return local * stages_ + stage_; }
  int stage_of_chunk(int64_t g) const { return static_cast<int>(g % stages_); }
  /// Sends in flight and the tensors they read, which must live until each is done.
  struct Outbox {
    std::vector<std::unique_ptr<CommWork>> works;
    std::vector<at::Tensor> tensors;
    void send(Communicator& comm, const at::Tensor& t, int dst, int tag);
    void wait();  ///< every send done; the tensors let go
  };
  void send_map(const TensorMap& map, int dst, int tag, Outbox& out);
  TensorMap recv_map(int src, int tag);
  void exchange_mirror_grads(const BackwardFn& backward);

  Communicator& comm_;
  PipelineConfig cfg_;
  c10::Device device_;
  int64_t stage_ = 0, stages_ = 1, virtual_ = 1;
  bool zero_bubble_ = false;  ///< ZB-H1: backwards split into B and W (the strategy's backward is not used)
  PipelinePlan plan_;
  std::vector<Chunk> chunks_;  ///< this stage's, by local index
  std::vector<int64_t> bounds_;  ///< every chunk's first layer, and the number of layers
  int64_t micro_batches_ = 1;
  std::vector<std::string> order_;  ///< module_state names, the model's order
  std::map<std::string, at::Tensor> params_;  ///< every parameter by name
  std::map<std::string, std::vector<int64_t>> shapes_;  ///< every parameter's shape (this TP rank's part)
  std::map<std::string, int64_t> primary_;  ///< parameter -> the stage that trains it
  std::set<std::string> trained_, dropped_;
  std::map<std::string, int64_t> mirror_of_;  ///< held here, trained elsewhere -> its primary stage
  std::map<std::string, std::vector<int64_t>> mirrors_on_;  ///< trained here -> the stages that mirror it
  std::string first_layer_, last_layer_;
  int64_t layer_count_ = 0, parameter_count_ = 0;
  PipelineStepStats stats_;
};

}  // namespace polytrain
