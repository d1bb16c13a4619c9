#include "polytrain/trainer/run_summary.h"

#include <cstdio>
#include <set>

#include <torch/nn/module.h>

#include "polytrain/common/error.h"
#include "polytrain/data/batch_source.h"

namespace polytrain {

namespace {

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

}  // namespace

std::string run_summary_line(const RunFacts& f) {
  const auto& c = f.ctx;
  std::string line = "run: env_type " + f.env_type + " | ";
  line += f.swarm ? "grid: swarm (target_batch_size " + std::to_string(f.global_batch) + ")"
                  : "world " + std::to_string(c.world_size) + " = tp " + std::to_string(c.tp_size) + " x pp " +
                        std::to_string(c.pp_size) + " x dp " + std::to_string(c.dp_size);
  if (f.zero_stage >= 0) {
    const bool opt = !(f.offload_optimizer == "none" || f.offload_optimizer.empty());
    const bool par = f.zero_stage == 3 && !(f.offload_param == "none" || f.offload_param.empty());
    line += " | ZeRO stage " + std::to_string(f.zero_stage) +
            (!opt && !par ? ", no offload" : "") + (opt ? ", offload_optimizer " + f.offload_optimizer : "") +
            (par ? ", offload_param " + f.offload_param : "");
  }
  line += " | comm " + f.comm + " | " + human_count(static_cast<double>(f.parameters)) + " parameters";
  if (f.tokens_per_sample > 0)
    line += " | " + std::to_string(f.global_batch * f.tokens_per_sample) + " tokens/step (" +
            std::to_string(f.global_batch) + " x " + std::to_string(f.tokens_per_sample) + ")";
  return line + " | experiment " + f.experiment_dir + (f.continued ? " (continued)" : "") + " | checkpoints " +
         f.save_dir + " | tensorboard " + f.tensorboard_dir;
}

nlohmann::json run_summary_record(const RunFacts& f, int64_t step) {
  const auto& c = f.ctx;
  return {{"step", step},
          {"run",
           {{"env_type", f.env_type}, {"world", c.world_size}, {"tp", c.tp_size}, {"pp", c.pp_size}, {"dp", c.dp_size},
            {"zero_stage", f.zero_stage < 0 ? 0 : f.zero_stage},
            {"offload_optimizer", f.zero_stage < 0 ? std::string("none") : f.offload_optimizer},
            {"offload_param", f.zero_stage == 3 && !f.offload_param.empty() ? f.offload_param : std::string("none")},
            {"comm", f.comm},
            {"parameters", f.parameters}, {"global_batch", f.global_batch},
            {"tokens_per_step", f.global_batch * f.tokens_per_sample}, {"experiment_dir", f.experiment_dir},
            {"continued", f.continued}, {"save_dir", f.save_dir}, {"tensorboard_dir", f.tensorboard_dir}}}};
}

int64_t count_parameters(torch::nn::Module& model) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : model.parameters(true))
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

int64_t tokens_per_sample(const BatchSource& data) {
  if (data.size() == 0) return 0;
  const Batch b = data.make_batch({0}, 0);
  return b.has("input_ids") && b.at("input_ids").dim() == 2 ? b.at("input_ids").size(1) : 0;
}

std::string comm_engine(const Config& cfg, const Backend& backend) {
  const std::string engine = backend.comm_engine();
  if (!engine.empty()) return engine;
  return cfg.trainer.env_type == "hivemind" ? "DHT + TCP streams (swarm)" : "none (one process)";
}

}  // namespace polytrain
