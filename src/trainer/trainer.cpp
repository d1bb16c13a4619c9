// The training loop. Order of one optimizer step (identical for every env_type):
//   lr <- schedule(applied updates so far); for each micro-batch until backend->ready_to_step:
//   batch <- this rank's slice of the global batch; loss <- forward_step; backend->backward(loss/GA);
//   then backend->step (reduce, finite check, clip, update), reduce the logged loss, log/eval/save.
// Sample order: a permutation per epoch (seed, epoch); global batch t takes positions
// [t*B, (t+1)*B); micro-batch m of data-parallel rank r takes B/GA/dp consecutive positions
// at t*B + (m*dp + r)*micro. So the set of samples in a global batch never depends on world size.
#include "trainer/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include "common/error.h"
#include "data/sample_order.h"
#include "models/activation_checkpoint.h"
#include "models/safetensors.h"
#include "parallel/backend.h"
#include "trainer/autocast.h"
#include "trainer/checkpoint.h"
#include "trainer/experiment.h"
#include "trainer/lr_schedule.h"
#include "trainer/metrics.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {

std::string step_tag(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "global_step%lld", static_cast<long long>(step));
  return buf;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// fp16 / bf16 (DeepSpeed's `fp16.enabled` / `bf16.enabled`): the forward runs under autocast in
// that type; parameters, gradients and optimizer state stay fp32 (the master weights).
std::optional<c10::ScalarType> precision_type(const Config& cfg) {
  if (cfg.fp16.enabled) return c10::kHalf;
  if (cfg.bf16.enabled) return c10::kBFloat16;
  return std::nullopt;
}

std::unique_ptr<AutocastGuard> maybe_autocast(const Config& cfg, const c10::Device& device) {
  if (auto t = precision_type(cfg)) return std::make_unique<AutocastGuard>(device.type(), *t);
  return nullptr;
}

}  // namespace

Trainer::Trainer(Config cfg) : cfg_(std::move(cfg)), best_eval_loss_(std::numeric_limits<double>::quiet_NaN()) {
  torch::manual_seed(cfg_.trainer.seed);
  if (cfg_.trainer.num_threads > 0) at::set_num_threads(static_cast<int>(cfg_.trainer.num_threads));
}

Trainer::~Trainer() = default;

EvalResult Trainer::evaluate(torch::nn::Module& model, const BatchSource& eval_data) {
  const auto& ctx = backend_->context();
  const int64_t micro = cfg_.batch.train_micro_batch_size_per_gpu;
  int64_t batches = eval_data.size() / micro;
  if (cfg_.data.eval_batches > 0) batches = std::min(batches, cfg_.data.eval_batches);
  EvalResult r;
  model.eval();
  torch::NoGradGuard no_grad;
  double sum = 0.0;
  int64_t mine = 0;
  // Eval micro-batches are dealt round-robin over data-parallel ranks; masks use epoch 0 so
  // every evaluation sees the same data.
  for (int64_t b = ctx.dp_rank; b < batches; b += ctx.dp_size) {
    std::vector<int64_t> idx(micro);
    for (int64_t i = 0; i < micro; ++i) idx[i] = b * micro + i;
    auto batch = eval_data.make_batch(idx, 0).to(ctx.device);
    auto autocast = maybe_autocast(cfg_, ctx.device);
    auto out = forward_step(batch, model);
    sum += out.loss.item<double>();
    ++mine;
  }
  model.train();
  // Mean over all batches: reduce sums and counts separately.
  const double total = backend_->reduce_metric(sum) * ctx.dp_size;
  const double count = backend_->reduce_metric(static_cast<double>(mine)) * ctx.dp_size;
  r.batches = static_cast<int64_t>(std::llround(count));
  r.loss = count > 0 ? total / count : std::numeric_limits<double>::quiet_NaN();
  r.perplexity = std::exp(r.loss);
  return r;
}

void Trainer::run_eval_and_record(torch::nn::Module& model, const BatchSource& eval_data, int64_t step) {
  auto r = evaluate(model, eval_data);
  metrics_->record(step, {{"eval_loss", r.loss}, {"eval_perplexity", r.perplexity}}, "eval/");
  metrics_->print_line("eval step " + std::to_string(step) + " | eval_loss " + fmt("%.4f", r.loss) +
                       " | perplexity " + fmt("%.2f", r.perplexity) + " | batches " +
                       std::to_string(r.batches));
  if (std::isfinite(r.loss) && (std::isnan(best_eval_loss_) || r.loss < best_eval_loss_)) {
    best_eval_loss_ = r.loss;
    save(model, step, "best");
  }
}

void Trainer::save(torch::nn::Module& model, int64_t step, const std::string& tag) {
  const bool is_best = tag == "best";
  nlohmann::json meta = {{"step", step},
                         {"skipped_steps", skipped_steps_},
                         {"loss_scaler", scaler_ ? scaler_->state() : nlohmann::json(nullptr)},
                         {"best_eval_loss", std::isnan(best_eval_loss_) ? nlohmann::json(nullptr)
                                                                       : nlohmann::json(best_eval_loss_)},
                         {"world_size", backend_->context().world_size},
                         {"dp_size", backend_->context().dp_size},
                         {"env_type", cfg_.trainer.env_type},
                         {"config", config_to_json(cfg_)}};
  if (!backend_->context().is_main()) return;  // rank 0 writes the (unsharded) state
  auto rng = at::detail::getDefaultCPUGenerator();
  at::Tensor rng_state;
  {
    std::lock_guard<std::mutex> lock(rng.mutex());
    rng_state = rng.get_state();
  }
  write_checkpoint(
      save_dir_, tag, meta,
      [&](torch::serialize::OutputArchive& a) {
        torch::serialize::OutputArchive m, b;
        save_module(model, m);
        backend_->save_state(b);
        a.write("model", m);
        a.write("backend", b);
        a.write("cpu_rng_state", rng_state);
      },
      /*set_latest=*/!is_best,
      [&](const std::string& tmp) {
        if (!cfg_.trainer.save_safetensors) return;
        std::vector<std::pair<std::string, torch::Tensor>> tensors;
        for (const auto& p : model.named_parameters(true)) tensors.emplace_back(p.key(), p.value().detach().cpu());
        save_safetensors((fs::path(tmp) / "model.safetensors").string(), tensors, {{"format", "pt"}});
      });
  if (is_best) return;
  saved_tags_.push_back(tag);
  while (cfg_.trainer.keep_last > 0 && static_cast<int64_t>(saved_tags_.size()) > cfg_.trainer.keep_last) {
    remove_checkpoint(save_dir_, saved_tags_.front());
    saved_tags_.erase(saved_tags_.begin());
  }
}

TrainResult Trainer::train(std::shared_ptr<torch::nn::Module> model, const BatchSource& train_data,
                           const BatchSource* eval_data) {
  PT_CHECK(model, "train() needs a model");
  backend_ = make_backend(cfg_);
  const RankContext& ctx = backend_->context();
  const auto& opts = cfg_.trainer;
  const int64_t global_batch = cfg_.batch.train_batch_size;
  const int64_t micro = cfg_.batch.train_micro_batch_size_per_gpu;
  const int64_t per_epoch = train_data.size() / global_batch;
  PT_INPUT_CHECK(per_epoch > 0, "the training split has ", train_data.size(),
                 " samples, fewer than train_batch_size ", global_batch);
  const int64_t total_steps = opts.max_steps > 0 ? opts.max_steps : opts.epochs * per_epoch;

  // Precision and memory options are checked before anything is written.
  PT_INPUT_CHECK(!cfg_.fp16.enabled || ctx.device.is_cuda(),
                 "fp16.enabled needs a CUDA device (trainer.pytorch_device cuda); on CPU use bf16.enabled");
  if (cfg_.fp16.enabled) scaler_.emplace(cfg_.fp16);
  if (opts.checkpoint_activations || cfg_.activation_checkpointing_present) {
    auto* ac = dynamic_cast<ActivationCheckpointing*>(model.get());
    PT_INPUT_CHECK(ac, "activation checkpointing (trainer.checkpoint_activations or an activation_checkpointing "
                       "block) is on, but this model does not implement polytrain::ActivationCheckpointing");
    ac->set_activation_checkpointing(true);
  }

  if (ctx.is_main()) {
    experiment_dir_ = create_experiment_dir(opts, config_to_json(cfg_));
  }
  save_dir_ = opts.save_dir.empty() ? (fs::path(experiment_dir_) / "checkpoints").string() : opts.save_dir;
  metrics_ = std::make_unique<MetricsLogger>(cfg_, experiment_dir_, ctx.is_main());

  backend_->prepare(model, cfg_);
  model->train();
  auto schedule = make_lr_schedule(cfg_.scheduler, cfg_.optimizer.lr);

  int64_t step = 0;
  // --load_dir D --save_dir D on a first start (or a restart before the first save): nothing
  // to resume yet, so start at step 0, as DeepSpeed's load_checkpoint does without 'latest'.
  const bool nothing_saved_yet = !opts.load_dir.empty() && !fs::exists(fs::path(opts.load_dir) / "latest") &&
                                 fs::weakly_canonical(opts.load_dir) == fs::weakly_canonical(save_dir_);
  if (nothing_saved_yet) metrics_->print_line("no checkpoint in " + opts.load_dir + " yet: starting at step 0");
  if (!opts.load_dir.empty() && !nothing_saved_yet) {
    const std::string tag = latest_checkpoint_tag(opts.load_dir);
    at::Tensor rng_state;
    auto meta = read_checkpoint(opts.load_dir, tag, [&](torch::serialize::InputArchive& a) {
      torch::serialize::InputArchive m, b;
      a.read("model", m);
      load_module(*model, m, opts.load_dir + "/" + tag + "/state.pt");
      a.read("backend", b);
      backend_->load_state(b);
      a.read("cpu_rng_state", rng_state);
    });
    step = meta.at("step").get<int64_t>();
    skipped_steps_ = meta.value("skipped_steps", int64_t{0});
    if (scaler_ && meta.contains("loss_scaler") && !meta["loss_scaler"].is_null()) scaler_->load_state(meta["loss_scaler"]);
    if (meta.contains("best_eval_loss") && meta["best_eval_loss"].is_number())
      best_eval_loss_ = meta["best_eval_loss"].get<double>();
    auto rng = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(rng.mutex());
    rng.set_state(rng_state);
    metrics_->print_line("resumed from " + opts.load_dir + "/" + tag + " at step " + std::to_string(step) +
                         " (saved at world size " + std::to_string(meta.value("world_size", 1)) + ")");
  }

  TrainResult result;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  auto interval_start = std::chrono::steady_clock::now();
  int64_t interval_steps = 0;
  double ms_per_step = 0.0;

  while (step < total_steps) {
    const int64_t epoch = step / per_epoch;
    if (epoch != order_epoch) {
      order = epoch_permutation(train_data.size(), opts.seed, epoch);
      order_epoch = epoch;
    }
    const int64_t base = (step % per_epoch) * global_batch;
    const int64_t lr_step = step - skipped_steps_;
    const double lr = schedule->lr(lr_step);
    const double loss_scale = scaler_ ? scaler_->scale() : 1.0;

    double loss_sum = 0.0;
    int64_t m = 0;
    for (; !backend_->ready_to_step(m); ++m) {
      const int64_t start = base + (m * ctx.dp_size + ctx.dp_rank) * micro;
      PT_CHECK(start + micro <= base + global_batch, "micro-batch ", m, " overruns the global batch");
      std::vector<int64_t> idx(order.begin() + start, order.begin() + start + micro);
      Batch batch = train_data.make_batch(idx, epoch).to(ctx.device);
      ModelOutput out;
      {
        auto autocast = maybe_autocast(cfg_, ctx.device);
        out = forward_step(batch, *model);
      }
      PT_CHECK(out.loss.defined(), "forward_step returned no loss");
      const int64_t accumulation = cfg_.batch.gradient_accumulation_steps;
      at::Tensor scaled = out.loss;
      if (loss_scale != 1.0) scaled = scaled.to(torch::kFloat) * loss_scale;  // a power of 2: exact
      backend_->backward(scaled / static_cast<double>(accumulation));
      loss_sum += out.loss.detach().item<double>();
    }
    const StepResult sr = backend_->step(lr, schedule->momentum(lr_step), loss_scale);
    const double loss = backend_->reduce_metric(loss_sum / static_cast<double>(m));
    ++step;
    ++interval_steps;
    result.losses.push_back(loss);
    if (!sr.applied) ++skipped_steps_;
    if (scaler_) {
      const std::string what = scaler_->update(!sr.applied);
      if (!what.empty()) metrics_->print_line("step " + std::to_string(step) + ": " + what);
    } else if (!sr.applied) {
      metrics_->print_line("step " + std::to_string(step) + ": non-finite gradients, update skipped");
    }

    const auto now = std::chrono::steady_clock::now();
    const double elapsed_ms = std::chrono::duration<double, std::milli>(now - interval_start).count();
    ms_per_step = elapsed_ms / static_cast<double>(interval_steps);
    metrics_->progress(step, total_steps, loss, ms_per_step);
    if ((opts.log_interval > 0 && step % opts.log_interval == 0) || step == total_steps) {
      const double samples_per_s = 1000.0 * global_batch / ms_per_step;
      metrics_->record(step,
                       {{"loss", loss}, {"lr", lr}, {"grad_norm", sr.grad_norm},
                        {"samples_per_second", samples_per_s}, {"ms_per_step", ms_per_step},
                        {"epoch", epoch}, {"skipped_steps", skipped_steps_},
                        {"loss_scale", scaler_ ? scaler_->scale() : 1.0}},
                       "train/");
      metrics_->print_line("step " + std::to_string(step) + "/" + std::to_string(total_steps) + " | " +
                           fmt("%.1f", ms_per_step) + " ms/step | lr " + fmt("%.3e", lr) + " | loss " +
                           fmt("%.4f", loss) + " | " + fmt("%.1f", samples_per_s) + " samples/s" +
                           (scaler_ ? " | loss scale " + fmt("%.0f", scaler_->scale()) : ""));
      interval_start = std::chrono::steady_clock::now();
      interval_steps = 0;
    }
    if (eval_data && opts.eval_interval > 0 && (step % opts.eval_interval == 0 || step == total_steps))
      run_eval_and_record(*model, *eval_data, step);
    if ((opts.save_interval > 0 && step % opts.save_interval == 0) || step == total_steps)
      save(*model, step, step_tag(step));
  }
  metrics_->finish();
  result.steps = step;
  result.skipped_steps = skipped_steps_;
  result.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  result.best_eval_loss = best_eval_loss_;
  result.experiment_dir = experiment_dir_;
  result.save_dir = save_dir_;
  return result;
}

}  // namespace polytrain
