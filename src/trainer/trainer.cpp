// The training loop. One optimizer step (identical for every env_type, see train_step):
//   lr <- schedule(updates applied so far); while the backend asks for another micro-batch of
//   n samples: read this rank's n samples, loss <- forward_step, backward(loss * n / samples
//   per step) -- so the step's gradient is the mean over its samples however they were split --
//   then backend->step (reduce, finite check, clip, update), reduce the logged loss.
// Around it: setup (checks, experiment folder by the rank with writes_logs, backend prepare),
// resume, log / eval / save. Which samples a rank reads is SampleStream's (data/sample_order.h),
// keyed by the backend's data shard, so the set of samples in a global batch never depends on
// the world size.
#include "polytrain/trainer/trainer.h"

#ifdef POLYTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include "polytrain/common/autocast.h"
#include "polytrain/common/blas_kernel.h"
#include "polytrain/ops/cpu_gemm.h"
#include "polytrain/common/cpu_budget.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/common/fault.h"
#include "polytrain/common/fault_tolerance_config.h"
#include "polytrain/common/self_launch.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/parallel/amp.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/comm_failure.h"
#include "polytrain/parallel/ddp/fault_tolerance.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/trainer/experiment.h"
#include "polytrain/trainer/interrupt_note.h"
#include "polytrain/trainer/run_summary.h"
#include "polytrain/optim/lr_schedule.h"
#include "polytrain/trainer/metrics.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

std::string step_tag(int64_t step) { return "global_step" + std::to_string(step); }

std::string rank_file(int64_t rank) { return "rank_" + std::to_string(rank) + ".pt"; }

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The forward's autocast type, resolved once: fp16 / bf16 (DeepSpeed's `fp16.enabled` /
// `bf16.enabled`: parameters, gradients and optimizer state stay fp32, the master weights), or
// `amp` where its plan patches functions (O1); O2 / O3 cast the model itself (the backend's
// build, parallel/amp.h). nullopt: no autocast.
std::optional<c10::ScalarType> autocast_of(const Config& cfg) {
  if (cfg.fp16.enabled) return c10::kHalf;
  if (cfg.bf16.enabled) return c10::kBFloat16;
  const AmpPlan amp = amp_plan(cfg.amp);
  if (amp.autocast) return amp_scalar_type(amp.half);
  return std::nullopt;
}

std::unique_ptr<AutocastGuard> maybe_autocast(std::optional<c10::ScalarType> type, const c10::Device& device) {
  return type ? std::make_unique<AutocastGuard>(device.type(), *type) : nullptr;
}

// Apex's output caster (a cast model's outputs in fp32, or amp.cast_model_outputs), resolved
// once; nullopt: outputs as computed.
std::optional<c10::ScalarType> output_cast_of(const Config& cfg) {
  const std::string dtype = amp_plan(cfg.amp).outputs;
  if (dtype.empty()) return std::nullopt;
  return amp_scalar_type(dtype);
}

void cast_outputs(std::optional<c10::ScalarType> type, ModelOutput& out) {
  if (!type) return;
  for (at::Tensor* x : {&out.loss, &out.logits, &out.hidden_states})
    if (x->defined() && x->is_floating_point() && x->scalar_type() != *type) *x = x->to(*type);
}

// What the amp block does, for the log.
std::string describe_amp(const AmpPlan& a, const std::string& level) {
  std::string s = "amp " + level + ": ";
  if (a.cast_model)
    s += a.half + " weights" + (a.keep_norm_fp32 ? " (normalization layers fp32)" : "") +
         (a.master_weights ? ", fp32 master weights in the optimizer" : ", optimizer on the " + a.half + " weights");
  else
    s += "fp32 weights";
  if (a.autocast) s += ", " + a.half + " autocast";
  s += a.loss_scale == 0.0 ? ", dynamic loss scale" : a.loss_scale == 1.0 ? ", no loss scaling" : ", static loss scale " + fmt("%g", a.loss_scale);
  if (!a.outputs.empty()) s += ", outputs " + a.outputs;
  return s;
}

std::string human_seconds(double s) {
  if (s < 60) return fmt("%.1fs", s);
  const long t = std::lround(s);
  if (t < 3600) return std::to_string(t / 60) + "m" + fmt("%02.0f", static_cast<double>(t % 60)) + "s";
  return std::to_string(t / 3600) + "h" + fmt("%02.0f", static_cast<double>(t / 60 % 60)) + "m";
}

// The experiment folder the latest checkpoint in `dir` was saved from; "" when none is recorded
// or the checkpoint cannot be read (resume() then reports what is wrong with it).
std::string recorded_experiment(const std::string& dir) {
  if (dir.empty() || !fs::exists(fs::path(dir) / "latest")) return "";
  try {
    const CheckpointReader ck(dir, latest_checkpoint_tag(dir));
    const auto& m = ck.meta();
    if (m.contains("experiment_dir") && m["experiment_dir"].is_string()) return m["experiment_dir"].get<std::string>();
  } catch (const InputError&) {
  }
  return "";
}

at::Tensor cpu_rng_state() {
  auto rng = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(rng.mutex());
  return rng.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto rng = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(rng.mutex());
  rng.set_state(state);
}

}  // namespace

Trainer::Trainer(Config cfg)
    : cfg_(std::move(cfg)),
      best_eval_loss_(std::numeric_limits<double>::quiet_NaN()),
      autocast_(autocast_of(cfg_)),
      output_cast_(output_cast_of(cfg_)) {
  // FlagAI's Trainer launches itself: a data-parallel run asking for several processes, started
  // without a launcher, becomes `launch ... PROGRAM ARGS` here (execv: nothing below runs).
  self_launch_if_asked(cfg_.trainer);
  torch::manual_seed(cfg_.trainer.seed);
  // All the CPUs this process may use (affinity, cgroup quota) divided among the processes the
  // launcher started on this host, unless trainer.num_threads or OMP_NUM_THREADS says otherwise.
  std::string thread_source;
  at::set_num_threads(default_thread_count(cfg_.trainer.num_threads, &thread_source));
  // The run's first line (the examples build their Trainer before anything else prints):
  // threads, BLAS and allocator, from rank 0 of a launched job (every peer of a swarm).
  int rank = 0;
  try {
    rank = read_dist_env().rank;
  } catch (const InputError&) {
    rank = 0;  // the backend reports a malformed job environment, naming the variable
  }
  if (rank == 0) {
    const std::string kernel = blas_kernel_note();
    std::printf("polytrain: threads %d (%s) | BLAS %s%s | fp32 GEMM %s | allocator %s\n", at::get_num_threads(),
                thread_source.c_str(), blas_description().c_str(), kernel.empty() ? "" : (" [kernel " + kernel + "]").c_str(),
                cpu_gemm::describe().c_str(), allocator_description().c_str());
    std::fflush(stdout);
  }
}

Trainer::~Trainer() = default;

std::string TrainResult::done_line() const {
  std::string s = "done: " + std::to_string(steps) + " steps, ";
  if (losses.empty())
    s += "no step left to take (already at step " + std::to_string(steps) + "; raise --max_steps to train further)";
  else
    s += "final loss " + fmt("%.4f", losses.back());
  if (!std::isnan(best_eval_loss)) s += ", best eval loss " + fmt("%.4f", best_eval_loss);
  return s + ", experiment " + experiment_dir + ", checkpoints " + save_dir;
}

void Trainer::set_backend(std::unique_ptr<Backend> backend) {
  PT_CHECK(!prepared_, "set_backend() after train() started");
  backend_ = std::move(backend);
}

Backend& Trainer::backend() {
  if (!backend_) backend_ = make_backend(cfg_);
  return *backend_;
}

EvalResult Trainer::evaluate(torch::nn::Module& model, const BatchSource& eval_data) {
  Backend& b = backend();
  const auto& ctx = b.context();
  if (!prepared_) model.to(ctx.device);
  const DataShard shard = b.data_shard();
  const int64_t micro = cfg_.batch.train_micro_batch_size_per_gpu;
  int64_t batches = eval_data.size() / micro;
  if (cfg_.data.eval_batches > 0) batches = std::min(batches, cfg_.data.eval_batches);
  model.eval();
  torch::NoGradGuard no_grad;
  if (prepared_) b.begin_eval();
  double sum = 0.0;
  int64_t mine = 0;
  // Eval micro-batches are dealt round-robin over the data shard's members (a peer with its own
  // stream evaluates all of them); masks use epoch 0 so every evaluation sees the same data.
  const int64_t first = shard.own_stream ? 0 : shard.member, stride = shard.own_stream ? 1 : shard.members;
  for (int64_t i = first; i < batches; i += stride) {
    std::vector<int64_t> idx(micro);
    for (int64_t k = 0; k < micro; ++k) idx[k] = i * micro + k;
    auto batch = eval_data.make_batch(idx, 0).to(ctx.device);
    auto autocast = maybe_autocast(autocast_, ctx.device);
    ModelOutput out;
    if (prepared_ && b.pipelined()) {
      out.loss = b.eval_forward(batch.tensors);  // the model's stage plan; the loss on the last stage
      if (!out.loss.defined()) out.loss = torch::zeros({}, torch::kDouble);  // reduce_metric takes the last stage's
    } else {
      out = forward_step(batch, model);
    }
    cast_outputs(output_cast_, out);
    sum += out.loss.item<double>();
    ++mine;
    fault_point("eval");
  }
  if (prepared_) b.end_eval();
  model.train();
  // Mean over all batches: reduce sums and counts separately.
  const double readers = shard.own_stream ? 1.0 : static_cast<double>(shard.members);
  const double total = b.reduce_metric(sum) * readers;
  const double count = b.reduce_metric(static_cast<double>(mine)) * readers;
  EvalResult r;
  r.batches = static_cast<int64_t>(std::llround(count));
  r.loss = count > 0 ? total / count : std::numeric_limits<double>::quiet_NaN();
  r.perplexity = std::exp(r.loss);
  return r;
}

void Trainer::run_eval_and_record(torch::nn::Module& model, const BatchSource& eval_data, const SampleStream& stream) {
  auto r = evaluate(model, eval_data);
  metrics_->record(step_, {{"eval_loss", r.loss}, {"eval_perplexity", r.perplexity}}, "eval/");
  metrics_->print_line("eval step " + std::to_string(step_) + " | eval_loss " + fmt("%.4f", r.loss) +
                       " | perplexity " + fmt("%.2f", r.perplexity) + " | batches " + std::to_string(r.batches));
  if (std::isfinite(r.loss) && (std::isnan(best_eval_loss_) || r.loss < best_eval_loss_)) {
    best_eval_loss_ = r.loss;
    save(model, "best", stream);
  }
}

// Every rank writes its part (see checkpoint.h): the consolidated model by the writes_model rank,
// the backend's shard where it has one, and its own RNG state and stream position.
void Trainer::save(torch::nn::Module& model, const std::string& tag, const SampleStream& stream) {
  Backend& b = *backend_;
  const RankContext& ctx = b.context();
  const NamedTensors full = b.full_state(model);  // collective
  CheckpointWriter w(save_dir_, tag,
                     CheckpointGroup{ctx.rank, ctx.world_size, ctx.commits_checkpoints, [&b] { b.barrier(); }});
  if (ctx.writes_model) {
    torch::serialize::OutputArchive a, m;
    save_named_tensors(full, m);
    a.write("model", m);
    w.write_archive("state.pt", a);
    if (cfg_.trainer.save_safetensors) {
      std::set<std::string> params;
      for (const auto& p : model.named_parameters(true)) params.insert(p.key());
      std::vector<std::pair<std::string, torch::Tensor>> tensors;
      uint64_t bytes = 0;
      for (const auto& [name, t] : full)
        if (params.count(name)) tensors.emplace_back(name, t.detach().cpu()), bytes += t.nbytes();
      w.produce_file(
          "model.safetensors", [&](const std::string& path) { save_safetensors(path, tensors, {{"format", "pt"}}); },
          bytes);
    }
  }
  if (b.writes_shard()) {
    torch::serialize::OutputArchive s;
    b.save_shard(s);
    w.write_archive(ShardReader::file_name(ctx.rank), s);
  }
  torch::serialize::OutputArchive own;
  own.write("cpu_rng_state", cpu_rng_state());
  own.write("stream_cursor", torch::tensor({stream.cursor()}, torch::kLong));
  w.write_archive(rank_file(ctx.rank), own);
  const nlohmann::json meta = {
      {"step", step_},
      {"applied_steps", applied_},
      {"skipped_steps", skipped_steps_},
      {"loss_scaler", scaler_ ? scaler_->state() : nlohmann::json(nullptr)},
      {"best_eval_loss", std::isnan(best_eval_loss_) ? nlohmann::json(nullptr) : nlohmann::json(best_eval_loss_)},
      {"world_size", ctx.world_size},
      {"dp_size", ctx.dp_size},
      {"grid", {{"world", ctx.world_size}, {"tp", ctx.tp_size}, {"dp", ctx.dp_size}, {"pp", ctx.pp_size}}},
      {"env_type", b.name()},
      {"experiment_dir", experiment_dir_.empty() ? nlohmann::json(nullptr)
                                                 : nlohmann::json(fs::absolute(experiment_dir_).lexically_normal().string())},
      {"config", config_to_json(cfg_)}};
  const bool is_best = tag == "best";
  w.commit(meta, /*set_latest=*/!is_best);
  if (is_best) return;
  interrupt_->set_checkpoint(save_dir_, tag);
  saved_tags_.push_back(tag);
  while (cfg_.trainer.keep_last > 0 && static_cast<int64_t>(saved_tags_.size()) > cfg_.trainer.keep_last) {
    if (ctx.commits_checkpoints) remove_checkpoint(save_dir_, saved_tags_.front());
    saved_tags_.erase(saved_tags_.begin());
  }
}

void Trainer::setup(const std::shared_ptr<torch::nn::Module>& model, const BatchSource& train_data) {
  Backend& b = backend();
  const RankContext& ctx = b.context();
  const auto& opts = cfg_.trainer;
  const int64_t global_batch = b.global_batch();  // a swarm's is its target; a fixed world's the batch triple's
  const int64_t per_epoch = train_data.size() / global_batch;
  PT_INPUT_CHECK(per_epoch > 0, "the training split has ", train_data.size(), " samples, fewer than train_batch_size ",
                 global_batch);
  // A replacement for a lost rank (fault tolerance) may join a group smaller than the job's start.
  const auto* elastic = dynamic_cast<const ElasticGroup*>(&b);
  PT_INPUT_CHECK(b.data_shard().own_stream || cfg_.batch.world_size == ctx.dp_size ||
                     (elastic && elastic->joined_at() >= 0 && elastic->original_members() == cfg_.batch.world_size),
                 "the batch sizes were resolved for a data-parallel size of ", cfg_.batch.world_size, ", but ", b.name(),
                 " runs ", ctx.dp_size, " data-parallel ranks (world ", ctx.world_size, " / model_parallel_size ",
                 ctx.tp_size, ")");
  total_steps_ = opts.max_steps > 0 ? opts.max_steps : opts.epochs * per_epoch;
  // Precision and memory options are checked before anything is written.
  PT_INPUT_CHECK(!cfg_.fp16.enabled || ctx.device.is_cuda(),
                 "fp16.enabled needs a CUDA device (trainer.pytorch_device cuda); on CPU use bf16.enabled");
  if (cfg_.fp16.enabled) scaler_.emplace(cfg_.fp16);
  if (autocast_ == c10::kBFloat16 && !ctx.device.is_cuda()) {
    // bf16 autocast (bf16.enabled, amp O1) on a CPU without native bf16 would run slower than
    // fp32, or not at all: fp32 instead, said once (every rank decides alike on its own CPU).
    const std::string why = cpu_bf16_fallback_reason(host_cpu_features(), std::getenv("POLYTRAIN_CPU_BF16"));
    if (!why.empty()) {
      autocast_.reset();
      if (ctx.writes_logs) std::printf("bf16: training in fp32 instead: %s\n", why.c_str()), std::fflush(stdout);
    }
  }
  if (ctx.device.is_cuda()) at::globalContext().setFloat32MatmulPrecision(opts.tf32 ? "high" : "highest");
  const AmpPlan amp = amp_plan(cfg_.amp);
  if (amp.enabled) {
    PT_INPUT_CHECK(amp.half != "float16" || ctx.device.is_cuda(),
                   "amp: float16 needs a CUDA device (trainer.pytorch_device cuda); on CPU set amp.dtype to \"bfloat16\"");
    const std::string refusal = b.amp_refusal();
    PT_INPUT_CHECK(refusal.empty(), refusal);
    if (amp.loss_scale != 1.0) {  // Apex's scaler: 2^16 (at most max_loss_scale), window 2000, no hysteresis
      Fp16Config s;
      s.loss_scale = amp.loss_scale;
      s.initial_scale_power = static_cast<int>(std::floor(std::log2(std::min(65536.0, amp.max_loss_scale))));
      s.loss_scale_window = 2000;
      s.hysteresis = 1;
      s.min_loss_scale = amp.min_loss_scale;
      scaler_.emplace(s, amp.max_loss_scale);
    }
  }
  if (opts.checkpoint_activations || cfg_.activation_checkpointing_present) {
    auto* ac = dynamic_cast<ActivationCheckpointing*>(model.get());
    PT_INPUT_CHECK(ac, "activation checkpointing (trainer.checkpoint_activations or an activation_checkpointing "
                       "block) is on, but this model does not implement polytrain::ActivationCheckpointing");
    ac->set_activation_checkpointing(true);
  }
  check_fault_tolerance();
  const int64_t parameters = count_parameters(*model);  // whole: the backend may shard it
  tokens_per_sample_ = tokens_per_sample(train_data);
  // The backend checks the model against its layout (a tensor-parallel plan, ...) before
  // anything is written.
  b.prepare(model, cfg_);
  prepared_ = true;
  open_experiment();
  print_run_summary(parameters);
  // Also the launcher's cue (supervisor.h): from here on, a lost rank does not stop the group.
  if (elastic_)
    metrics_->print_line("fault tolerance: on, " + std::to_string(elastic_->original_members()) + " ranks, min_world_size " +
                         std::to_string(fault_tolerance_options(cfg_).min_world_size) +
                         " (a lost rank's micro-batches go to the others and the interrupted step is redone)");
  if (amp.enabled) metrics_->print_line(describe_amp(amp, cfg_.amp.opt_level));
  model->train();
  schedule_ = make_lr_schedule(cfg_.scheduler, cfg_.optimizer.lr);
}

// The experiment folder: the resumed run's when this run continues it (experiment.h), else a
// new one; then the checkpoint folder and the metric sinks.
void Trainer::open_experiment() {
  Backend& b = *backend_;
  const RankContext& ctx = b.context();
  const auto& opts = cfg_.trainer;
  if (ctx.writes_logs) {
    experiment_dir_ = continued_experiment_dir(opts, recorded_experiment(opts.load_dir));
    experiment_created_ = experiment_dir_.empty();
    if (experiment_created_) experiment_dir_ = create_experiment_dir(opts, config_to_json(cfg_));
  }
  // Every rank writes into the same checkpoint folder; only the folder's creator knows its name.
  save_dir_ = opts.save_dir.empty() ? b.share((fs::path(experiment_dir_) / "checkpoints").string()) : opts.save_dir;
  metrics_ = std::make_unique<MetricsLogger>(cfg_, experiment_dir_, ctx.writes_logs);
  interrupt_ = std::make_unique<InterruptNote>(ctx.writes_logs);
}

// One line before the first step, on the console and in metrics.jsonl (run_summary.h), printed
// first so that a run that dies is found.
void Trainer::print_run_summary(int64_t parameters) {
  Backend& b = *backend_;
  const std::string& type = cfg_.trainer.env_type;
  RunFacts f;
  f.env_type = type;
  f.ctx = b.context();
  f.swarm = b.data_shard().own_stream;
  f.global_batch = b.global_batch();
  f.tokens_per_sample = tokens_per_sample_;
  f.parameters = parameters;
  if (type == "deepspeed" || type == "deepspeed+mpu") {
    f.zero_stage = cfg_.zero_optimization.stage;
    f.offload_optimizer = cfg_.zero_optimization.offload_optimizer.device;
    f.offload_param = cfg_.zero_optimization.offload_param.device;
  }
  f.comm = comm_engine(cfg_, b);
  f.experiment_dir = experiment_dir_;
  f.continued = !experiment_created_;
  f.save_dir = save_dir_;
  f.tensorboard_dir = tensorboard_dir(cfg_, experiment_dir_);
  metrics_->print_line(run_summary_line(f));
  metrics_->note(run_summary_record(f, step_));
  if (const std::string layout = b.pipeline_layout(); !layout.empty()) metrics_->print_line(layout);
}

void Trainer::resume(torch::nn::Module& model, SampleStream& stream) {
  const auto& opts = cfg_.trainer;
  if (opts.load_dir.empty()) return;
  // --load_dir D --save_dir D on a first start (or a restart before the first save): nothing
  // to resume yet, so start at step 0, as DeepSpeed's load_checkpoint does without 'latest'.
  if (!fs::exists(fs::path(opts.load_dir) / "latest") &&
      fs::weakly_canonical(opts.load_dir) == fs::weakly_canonical(save_dir_)) {
    metrics_->print_line("no checkpoint in " + opts.load_dir + " yet: starting at step 0");
    return;
  }
  Backend& b = *backend_;
  const RankContext& ctx = b.context();
  const std::string tag = latest_checkpoint_tag(opts.load_dir);
  const CheckpointReader ck(opts.load_dir, tag);
  const auto& meta = ck.meta();
  ck.read_archive("state.pt", [&](torch::serialize::InputArchive& a) {
    torch::serialize::InputArchive m;
    a.read("model", m);
    b.load_full_state(model, load_named_tensors_archive(m), ck.path("state.pt"));
  });
  ShardReader shards(ck);
  b.load_shards(shards);
  // A rank of the same layout resumes its own RNG and stream; at another layout every rank
  // starts from rank 0's (data-parallel ranks draw the same random numbers).
  const int64_t saved_world = meta.value("world_size", int64_t{1});
  const std::string own = saved_world == ctx.world_size && ck.has_file(rank_file(ctx.rank)) ? rank_file(ctx.rank) : rank_file(0);
  ck.read_archive(own, [&](torch::serialize::InputArchive& a) {
    at::Tensor rng, cursor;
    a.read("cpu_rng_state", rng);
    a.read("stream_cursor", cursor);
    set_cpu_rng_state(rng);
    stream.set_cursor(cursor.item<int64_t>());
  });
  // Another micro-batch / accumulation split of the same global batch resumes; another global
  // batch would change what a step means (the data position, the LR schedule's steps).
  if (meta.contains("config") && meta["config"].is_object() && meta["config"].contains("train_batch_size") &&
      meta["config"]["train_batch_size"].is_number_integer() && !b.data_shard().own_stream) {
    const int64_t saved_batch = meta["config"]["train_batch_size"].get<int64_t>();
    PT_INPUT_CHECK(saved_batch == b.global_batch(), ck.path("complete.json"), ": saved with train_batch_size ",
                   saved_batch, ", this run has ", b.global_batch(), "; a resume keeps the global batch (any micro-batch "
                   "and gradient_accumulation_steps that multiply to it, at any world size)");
  }
  PT_INPUT_CHECK(meta.contains("step"), ck.path("complete.json"), ": no 'step' (not saved by a training job)");
  step_ = meta["step"].get<int64_t>();  // the marker's schema is checked by CheckpointReader
  b.set_global_step(step_);
  skipped_steps_ = meta.value("skipped_steps", int64_t{0});
  applied_ = meta.value("applied_steps", step_ - skipped_steps_);
  if (scaler_ && meta.contains("loss_scaler") && !meta["loss_scaler"].is_null()) scaler_->load_state(meta["loss_scaler"]);
  if (meta.contains("best_eval_loss") && meta["best_eval_loss"].is_number())
    best_eval_loss_ = meta["best_eval_loss"].get<double>();
  metrics_->print_line("resumed from " + opts.load_dir + "/" + tag + " at step " + std::to_string(step_) +
                       " (saved at world size " + std::to_string(saved_world) + ")");
  interrupt_->set_checkpoint(opts.load_dir, tag);
  interrupt_->set_step(step_);
}

StepResult Trainer::train_step(torch::nn::Module& model, const BatchSource& data, SampleStream& stream,
                               const StepRequest& request, double* loss) {
  Backend& b = *backend_;
  // The loop's side of the backend's micro-batch schedule: data, forward_step, loss bookkeeping.
  struct Runner final : MicroBatchRunner {
    Trainer& t;
    torch::nn::Module& model;
    const BatchSource& data;
    SampleStream& stream;
    const StepRequest& request;
    c10::Device device;
    int64_t readers;
    double per_step;
    at::Tensor loss_sum;  // sum over micro-batches of (mean loss x samples), on the device: read once per step
    int64_t samples = 0;
    double forward_ms = 0;
    // Fault tolerance: micro-batch m is plan[m]; another member's micro-batch k draws the dropout
    // numbers this rank's own micro-batch k drew (data-parallel ranks share one RNG stream).
    const std::vector<MicroBatchSlot>* plan = nullptr;
    int64_t members = 1;
    std::function<SampleStream&(int64_t member)> stream_of;
    int64_t micro_steps = 0;
    std::vector<at::Tensor> rng_before;  // before own micro-batch k
    at::Tensor rng_after_own;
    SampleStream::Draw draw(int64_t n) {
      const int64_t m = micro_steps++;
      if (!plan || plan->empty()) return stream.next(t.step_, samples * readers, n);
      const MicroBatchSlot& slot = plan->at(static_cast<size_t>(m));
      if (slot.member == plan->front().member) {
        rng_before.push_back(cpu_rng_state());
      } else {
        if (!rng_after_own.defined()) rng_after_own = cpu_rng_state();
        set_cpu_rng_state(rng_before.at(static_cast<size_t>(slot.index)));
      }
      return stream_of(slot.member).next(t.step_, slot.index * n * members, n);
    }
    // After the step's micro-batches: the RNG where the own ones left it, as in a run without losses.
    void finish() {
      if (rng_after_own.defined()) set_cpu_rng_state(rng_after_own);
    }
    Runner(Trainer& t_, torch::nn::Module& m, const BatchSource& d, SampleStream& s, const StepRequest& r, Backend& b)
        : t(t_), model(m), data(d), stream(s), request(r), device(b.context().device), readers(b.data_shard().members),
          per_step(static_cast<double>(b.samples_per_step())) {}
    at::Tensor forward(int64_t n) override {
      const auto t0 = Clock::now();
      Batch batch = read_batch(n);
      ModelOutput out;
      {
        auto autocast = maybe_autocast(t.autocast_, device);
        out = t.forward_step(batch, model);
      }
      forward_ms += ms_since(t0);
      return weigh_output(out, n);
    }
    Batch read_batch(int64_t n) {
      const auto d = draw(n);
      t.epoch_ = d.epoch;
      samples += n;
      return data.make_batch(d.indices, d.epoch).to(device);
    }
    at::Tensor weigh_output(ModelOutput& out, int64_t n) {
      cast_outputs(t.output_cast_, out);
      PT_CHECK(out.loss.defined(), "forward_step returned no loss");
      at::Tensor scaled = out.loss;
      if (request.loss_scale != 1.0) scaled = scaled.to(torch::kFloat) * request.loss_scale;  // a power of 2: exact
      auto weighted = out.loss.detach().to(torch::kDouble) * static_cast<double>(n);
      loss_sum = loss_sum.defined() ? loss_sum + weighted : weighted;
      return scaled / (per_step / static_cast<double>(n));
    }
    // A pipeline schedule: the model's stage plan runs instead of forward_step.
    std::map<std::string, at::Tensor> read(int64_t n) override { return read_batch(n).tensors; }
    at::Tensor weigh(const at::Tensor& loss, int64_t n) override {
      ModelOutput out;
      out.loss = loss;
      return weigh_output(out, n);
    }
    void autocast(const std::function<void()>& fn) override {
      auto autocast = maybe_autocast(t.autocast_, device);
      fn();
    }
  } runner(*this, model, data, stream, request, b);
  if (elastic_) {
    runner.plan = &elastic_->plan();
    runner.members = elastic_->original_members();
    runner.stream_of = [&](int64_t member) -> SampleStream& { return member_stream(member, stream, data.size()); };
  }
  const auto t_mb = Clock::now();
  b.run_micro_batches(runner);
  runner.finish();
  interval_ms_[1] += runner.forward_ms;
  interval_ms_[2] += ms_since(t_mb) - runner.forward_ms;  // the backwards (and a schedule's waits)
  PT_CHECK(runner.samples > 0, b.name(), " asked for no micro-batch in step ", step_ + 1);
  // The step's host syncs on a GPU: this read of the loss (once the backward is queued) and
  // the gradient norm in b.step; the next batch is made and copied while the update runs.
  // A pipeline's earlier stages hold no loss: reduce_metric takes the last stage's.
  const double loss_total = runner.loss_sum.defined() ? runner.loss_sum.item<double>() : 0.0;
  if (elastic_) {
    // Before the update: a failure in any collective of the step then leaves the weights alone.
    *loss = b.reduce_metric(loss_total / elastic_->loss_divisor());
    const auto t0 = Clock::now();
    const StepResult r = b.step(request, step_);
    interval_ms_[3] += ms_since(t0);
    return r;
  }
  const auto t0 = Clock::now();
  const StepResult r = b.step(request, step_);
  interval_ms_[3] += ms_since(t0);
  *loss = b.reduce_metric(loss_total / static_cast<double>(runner.samples));
  return r;
}

void Trainer::record_step(const StepResult& r, double loss, double lr) {
  // A swarm peer that finds the swarm ahead jumps to its step: the LR schedule follows it.
  // A peer that reloaded the swarm's state instead of stepping (kNoUpdate) counts its updates.
  const int64_t own = r.outcome == StepOutcome::kApplied ? 1 : 0;
  if (r.global_step > step_ + 1 || (r.outcome == StepOutcome::kNoUpdate && r.global_step > step_))
    applied_ += r.global_step - step_ - own;
  step_ = r.global_step;
  if (r.outcome == StepOutcome::kApplied) ++applied_;
  if (r.outcome == StepOutcome::kSkippedNonFinite) ++skipped_steps_;
  if (scaler_ && r.outcome != StepOutcome::kNoUpdate) {
    const std::string what = scaler_->update(!r.applied());
    if (!what.empty()) metrics_->print_line("step " + std::to_string(step_) + ": " + what);
  } else if (r.outcome == StepOutcome::kSkippedNonFinite) {
    metrics_->print_line("step " + std::to_string(step_) + ": non-finite gradients, update skipped");
  }
  interrupt_->set_step(step_);
  ++interval_steps_;
  const double ms_per_step = interval_ms_[0] / static_cast<double>(interval_steps_);
  metrics_->progress(step_, total_steps_, loss, ms_per_step);
  const auto& opts = cfg_.trainer;
  if (!((opts.log_interval > 0 && step_ % opts.log_interval == 0) || step_ >= total_steps_)) return;
  const double samples_per_s = 1000.0 * static_cast<double>(r.samples) / ms_per_step;
  const double tokens_per_s = samples_per_s * static_cast<double>(tokens_per_sample_);
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - started_).count();
  nlohmann::json fields = {{"loss", loss},
                           {"lr", lr},
                           {"grad_norm", r.grad_norm},
                           {"samples_per_second", samples_per_s},
                           {"tokens_per_second", tokens_per_s},
                           {"elapsed_s", elapsed_s},
                           {"ms_per_step", ms_per_step},
                           {"epoch", epoch_},
                           {"skipped_steps", skipped_steps_},
                           {"loss_scale", scaler_ ? scaler_->scale() : 1.0}};
  std::string line = "step " + std::to_string(step_) + "/" + std::to_string(total_steps_) + " | " +
                     fmt("%.1f", ms_per_step) + " ms/step | lr " + fmt("%.3e", lr) + " | loss " + fmt("%.4f", loss) +
                     " | " + fmt("%.1f", samples_per_s) + " samples/s" +
                     (tokens_per_sample_ > 0 ? " | " + fmt("%.0f", tokens_per_s) + " tokens/s" : "") +
                     " | elapsed " + human_seconds(elapsed_s) +
                     (scaler_ ? " | loss scale " + fmt("%.0f", scaler_->scale()) : "");
#ifdef POLYTRAIN_WITH_CUDA
  if (backend_->context().device.is_cuda()) {  // the caching allocator's peak since the start
    const auto index = backend_->context().device.index() < 0 ? 0 : backend_->context().device.index();
    const double peak_gb = c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak / 1e9;
    fields["gpu_mem_peak_gb"] = peak_gb;
    line += " | GPU peak " + fmt("%.2f", peak_gb) + " GB";
  }
#endif
  if (r.group_size > 0) {  // a swarm's step: how many peers it averaged with
    fields["group_size"] = r.group_size;
    line += " | group " + std::to_string(r.group_size);
  }
  if (r.sent_bytes >= 0) {  // the averaging traffic of the step
    fields["sent_bytes"] = r.sent_bytes, fields["received_bytes"] = r.received_bytes;
    line += " | sent " + fmt("%.2f", static_cast<double>(r.sent_bytes) / 1e6) + " MB, received " +
            fmt("%.2f", static_cast<double>(r.received_bytes) / 1e6) + " MB";
  }
  if (cfg_.wall_clock_breakdown) {  // DeepSpeed's timers: where the step's time went
    const double n = static_cast<double>(interval_steps_);
    fields["forward_ms"] = interval_ms_[1] / n, fields["backward_ms"] = interval_ms_[2] / n;
    fields["step_ms"] = interval_ms_[3] / n;
    line += " | forward " + fmt("%.1f", interval_ms_[1] / n) + " ms, backward " + fmt("%.1f", interval_ms_[2] / n) +
            " ms, step " + fmt("%.1f", interval_ms_[3] / n) + " ms";
  }
  if (r.contributed_samples >= 0) fields["contributed_samples"] = r.contributed_samples;
  metrics_->record(step_, fields, "train/");
  metrics_->print_line(line);
  // A swarm peer's own share, as hivemind's collaborative-training peers print it.
  if (r.contributed_samples >= 0)
    metrics_->print_line("Your current contribution: " + std::to_string(r.contributed_samples) + " samples");
  interval_steps_ = 0;
  for (double& t : interval_ms_) t = 0.0;
}

// trainer.fault_tolerance needs a backend that can regroup (an ElasticGroup).
void Trainer::check_fault_tolerance() {
  if (!fault_tolerance_options(cfg_).enabled) return;
  elastic_ = dynamic_cast<ElasticGroup*>(backend_.get());
  PT_INPUT_CHECK(elastic_, "trainer.fault_tolerance: env_type ", cfg_.trainer.env_type,
                 cfg_.zero_optimization.stage > 0 ? " with ZeRO" : "", " cannot survive lost ranks (pytorchDDP over Gloo can)");
}

SampleStream& Trainer::member_stream(int64_t member, SampleStream& own, int64_t dataset_size) {
  if (member == elastic_->plan().front().member) return own;
  auto& s = member_streams_[member];
  if (!s)
    s = std::make_unique<SampleStream>(dataset_size, cfg_.trainer.seed, cfg_.batch.train_batch_size, member,
                                       elastic_->original_members(), false);
  return *s;
}

// One step; with fault tolerance, a step whose collectives fail because ranks are lost is redone
// by the survivors over the same global batch, from the same RNG state.
StepResult Trainer::step_surviving_failures(torch::nn::Module& model, const BatchSource& data, SampleStream& stream,
                                            StepRequest& request, double* loss) {
  if (!elastic_) return train_step(model, data, stream, request, loss);
  while (true) {
    at::Tensor rng;
    const auto t0 = Clock::now();
    try {
      // At the step boundary: replacements for lost ranks join and get the live state, with
      // which a replacement's progress arrives (the step's LR and loss scale follow it).
      if (admit_replacements(stream))
        request = StepRequest{schedule_->lr(applied_), schedule_->momentum(applied_), scaler_ ? scaler_->scale() : 1.0};
      rng = cpu_rng_state();
      return train_step(model, data, stream, request, loss);
    } catch (const CommFailure& e) {
      if (rng.defined()) set_cpu_rng_state(rng);
      const std::string step = std::to_string(step_ + 1);
      regroup_after(e.what(), t0, step_ + 1, "at step " + step,
                    "step " + step + " redone over the same " + std::to_string(backend_->global_batch()) + " samples");
    }
  }
}

// Fault tolerance at a step boundary (collective): while ranks are missing, replacements that
// launch started join the group; then any member that lacks the live state gets it from rank 0
// (a replacement before its first step; again when a loss interrupted the transfer). One line and
// a metrics.jsonl record per admission, once the state is across.
bool Trainer::admit_replacements(SampleStream& stream) {
  const auto t0 = Clock::now();
  const MembershipChange c = elastic_->admit(step_);
  if (!c.joined.empty()) {
    admitting_since_ = t0;
    admitting_.insert(admitting_.end(), c.joined.begin(), c.joined.end());
    admitting_members_ = c.members;
    admitting_generation_ = c.generation;
  }
  std::string received;
  const bool loaded = elastic_->share_live_state([&] { return live_state(stream); }, &received);
  if (loaded) load_live_state(received, stream);
  if (admitting_.empty()) return loaded;
  const double s = ms_since(admitting_since_) / 1000.0;
  const auto ranks = [](const std::vector<int64_t>& r) { return (r.size() > 1 ? "ranks " : "rank ") + rank_list(r); };
  const std::string step = std::to_string(step_ + 1);
  metrics_->print_line("fault tolerance: " + ranks(admitting_) + " joined at step " + step +
                       " (a replacement started by launch, with the live state of rank 0); " +
                       std::to_string(admitting_members_.size()) + " ranks go on (" + ranks(admitting_members_) +
                       " of the start); " + fmt("%.1f", s) + " s spent");
  metrics_->note({{"event", "membership_change"}, {"step", step_ + 1}, {"when", "at step " + step},
                  {"joined", admitting_}, {"left", std::vector<int64_t>{}}, {"members", admitting_members_},
                  {"generation", admitting_generation_}, {"seconds_lost", s}});
  admitting_.clear();
  return loaded;
}

// The trainer's part of the live state a replacement takes: progress, RNG and data position
// (the model and the optimizer travel with it, from the backend).
std::string Trainer::live_state(const SampleStream& stream) const {
  const at::Tensor rng = cpu_rng_state().contiguous();
  const auto* bytes = rng.data_ptr<uint8_t>();
  nlohmann::json j = {{"step", step_},
                      {"applied", applied_},
                      {"skipped", skipped_steps_},
                      {"epoch", epoch_},
                      {"cursor", stream.cursor()},
                      {"rng", std::vector<uint8_t>(bytes, bytes + rng.numel())},
                      {"loss_scaler", scaler_ ? scaler_->state() : nlohmann::json(nullptr)},
                      {"best_eval_loss", std::isnan(best_eval_loss_) ? nlohmann::json(nullptr) : nlohmann::json(best_eval_loss_)}};
  return j.dump();
}

void Trainer::load_live_state(const std::string& state, SampleStream& stream) {
  const nlohmann::json j = nlohmann::json::parse(state);
  step_ = j.at("step").get<int64_t>();
  backend_->set_global_step(step_);
  applied_ = j.at("applied").get<int64_t>();
  skipped_steps_ = j.at("skipped").get<int64_t>();
  epoch_ = j.at("epoch").get<int64_t>();
  stream.set_cursor(j.at("cursor").get<int64_t>());
  const auto rng = j.at("rng").get<std::vector<uint8_t>>();
  set_cpu_rng_state(at::from_blob(const_cast<uint8_t*>(rng.data()), {static_cast<int64_t>(rng.size())}, at::kByte).clone());
  if (scaler_ && !j.at("loss_scaler").is_null()) scaler_->load_state(j.at("loss_scaler"));
  if (!j.at("best_eval_loss").is_null()) best_eval_loss_ = j.at("best_eval_loss").get<double>();
  interrupt_->set_step(step_);
}

// With fault tolerance, an evaluation or a checkpoint that a lost rank interrupts is done again by
// the survivors (a checkpoint's unfinished folder is never loaded and the next save clears it).
void Trainer::surviving(const std::string& what, const std::function<void()>& work) {
  while (true) {
    const auto t0 = Clock::now();
    try {
      work();
      return;
    } catch (const CommFailure& e) {
      if (!elastic_) throw;
      regroup_after(e.what(), t0, step_, "during " + what, what + " redone");
    }
  }
}

// The regroup, then one membership line and a metrics.jsonl record: who left, who goes on, what
// is redone and the seconds lost since `since` (the interrupted attempt's start); `step`: the
// step redone, or the one whose evaluation or checkpoint is.
void Trainer::regroup_after(const std::string& why, Clock::time_point since, int64_t step, const std::string& when,
                            const std::string& redone) {
  const MembershipChange c = elastic_->regroup(step_);
  if (!admitting_.empty()) {  // a replacement whose state is not across yet: it may be lost, the group changed
    for (int64_t m : c.left) admitting_.erase(std::remove(admitting_.begin(), admitting_.end(), m), admitting_.end());
    admitting_members_ = c.members;
    admitting_generation_ = c.generation;
  }
  const double lost_s = ms_since(since) / 1000.0;
  const auto ranks = [](const std::vector<int64_t>& r) { return (r.size() > 1 ? "ranks " : "rank ") + rank_list(r); };
  metrics_->print_line("fault tolerance: " + ranks(c.left) + " left " + when + " (" + why + "); " +
                       std::to_string(c.members.size()) + (c.members.size() > 1 ? " ranks go on (" : " rank goes on (") +
                       ranks(c.members) + " of the start), " + redone + "; " + fmt("%.1f", lost_s) + " s lost");
  metrics_->note({{"event", "membership_change"}, {"step", step}, {"when", when}, {"left", c.left},
                  {"members", c.members}, {"generation", c.generation}, {"seconds_lost", lost_s}, {"reason", why}});
}

TrainResult Trainer::train(std::shared_ptr<torch::nn::Module> model, const BatchSource& train_data,
                           const BatchSource* eval_data) {
  PT_CHECK(model, "train() needs a model");
  started_ = Clock::now();
  try {
    setup(model, train_data);
    TrainResult result = run_loop(*model, train_data, eval_data);
    interrupt_.reset();
    return result;
  } catch (...) {
    interrupt_.reset();
    // A run that failed before its first step leaves no empty folder behind.
    if (experiment_created_ && steps_run_ == 0) {
      metrics_.reset();
      remove_experiment_dir(experiment_dir_);
      experiment_created_ = false;
    }
    throw;
  }
}

TrainResult Trainer::run_loop(torch::nn::Module& model, const BatchSource& train_data,
                              const BatchSource* eval_data) {
  DataShard shard = backend_->data_shard();
  // Fault tolerance: a rank reads its own samples of each global batch, whatever its place in
  // the group after losses and replacements.
  if (elastic_) shard.member = elastic_->original_rank(), shard.members = elastic_->original_members();
  SampleStream stream(train_data.size(), shard.order_seed ? shard.order_seed : cfg_.trainer.seed,
                      cfg_.batch.train_batch_size, shard.member, shard.members, shard.own_stream);
  // A replacement for a lost rank loads no checkpoint: the live state comes from rank 0 at its first step.
  if (elastic_ && elastic_->joined_at() >= 0) {
    step_ = elastic_->joined_at();
    interrupt_->set_step(step_);
  } else {
    resume(model, stream);
  }
  if (const int64_t joined = backend_->catch_up(step_); joined > step_) {
    applied_ += joined - step_;  // the swarm's updates, loaded with its state
    step_ = joined;
  }
  const auto& opts = cfg_.trainer;
  TrainResult result;
  if (backend_->assists_only()) {
    // An auxiliary peer (hivemind.assist_in_averaging): the model only gave the shapes of what
    // the swarm averages. It trains, evaluates and saves nothing (its weights are never
    // updated), and ends with the swarm's last step.
    step_ = backend_->assist(step_, total_steps_);
    metrics_->finish();
    result.steps = step_;
    result.best_eval_loss = best_eval_loss_;
    result.experiment_dir = experiment_dir_;
    result.save_dir = save_dir_;
    return result;
  }
  while (step_ < total_steps_) {
    const auto t0 = Clock::now();
    StepRequest request{schedule_->lr(applied_), schedule_->momentum(applied_), scaler_ ? scaler_->scale() : 1.0};
    double loss = 0.0;
    const StepResult r = step_surviving_failures(model, train_data, stream, request, &loss);
    interval_ms_[0] += ms_since(t0);
    result.losses.push_back(loss);
    ++steps_run_;
    record_step(r, loss, request.lr);
    fault_point("step");
    if (eval_data && opts.eval_interval > 0 && (step_ % opts.eval_interval == 0 || step_ >= total_steps_))
      surviving("the evaluation of step " + std::to_string(step_),
                [&] { run_eval_and_record(model, *eval_data, stream); });
    if ((opts.save_interval > 0 && step_ % opts.save_interval == 0) || step_ >= total_steps_)
      surviving("the checkpoint of step " + std::to_string(step_), [&] { save(model, step_tag(step_), stream); });
  }
  metrics_->finish();
  backend_->release_model(model);  // a split model is whole again (collective)
  result.steps = step_;
  result.skipped_steps = skipped_steps_;
  result.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  result.best_eval_loss = best_eval_loss_;
  result.experiment_dir = experiment_dir_;
  result.save_dir = save_dir_;
  return result;
}

}  // namespace polytrain
