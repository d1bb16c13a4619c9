// What the config means: each section read with DeepSpeed's defaults and rules, validated, the
// batch triple resolved (DeepSpeed's fill-in rules), and config_to_json. The key lists, the strict
// reader and parse_json_strict are in config_keys.{h,cpp}; CLI flags are in cli_config.{h,cpp}.
#include "polytrain/common/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "polytrain/common/config_keys.h"
#include "polytrain/common/config_paths.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/models/model_keys.h"
#include "polytrain/optim/optimizer_registry.h"
#include "polytrain/parallel/parallel_dims.h"

namespace polytrain {

using nlohmann::json;
using namespace config_detail;
using detail::cat;

namespace {

// The optimizers a config can name: the registry's (optim's optimizer_registry.h).
std::vector<std::string> known_optimizers() {
  std::vector<std::string> out;
  for (const auto& e : optimizer_registry()) out.push_back(e.name);
  return out;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : sep) + i;
  return out;
}
const std::vector<std::string> kDeepSpeedOnlyOptimizers = {"OneBitAdam", "ZeroOneAdam", "OneBitLamb",
                                                           "MuAdam", "MuAdamW", "MuSGD", "Lion"};
const std::vector<std::string> kSchedulers = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                              "OneCycle", "LRRangeTest"};
const std::vector<std::string> kEnvTypes = {"pytorch", "pytorchDDP", "deepspeed", "deepspeed+mpu",
                                            "hivemind"};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// ---- sections: read, then check ranges (messages name the key and the value) ---------------

void parse_optimizer(const json* j, ParseContext& ctx, OptimizerConfig& o) {
  ObjectReader r(j, "optimizer", ctx);
  std::string type = o.type;
  r("type", type);
  r("no_decay", o.no_decay);
  r.ignore({{"legacy_fusion", "false"}});
  const json* params = r.take("params");
  r.finish();
  o.type.clear();
  const std::vector<std::string> known = known_optimizers();
  for (const auto& name : known)
    if (lower(name) == lower(type)) o.type = name;
  for (const auto& name : kDeepSpeedOnlyOptimizers)
    if (lower(name) == lower(type))
      r.fail("type", "'" + type + "' is a DeepSpeed optimizer polytrain does not implement; use one of " +
                         join(known, ", "));
  if (o.type.empty()) r.one_of("type", type, known);
  if (o.type == "Adagrad") o.eps = 1e-10;  // torch.optim.Adagrad's default

  ObjectReader p(params, "optimizer.params", ctx);
  if (p.has("max_grad_norm"))
    p.fail("max_grad_norm", "is not an optimizer parameter in DeepSpeed; set the top-level "
                            "'gradient_clipping' instead");
  visit(p, o);
  if (o.type == "Adam" || o.type == "AdamW" || o.type == "CPUAdam") p.accept("torch_adam");  // same math either way
  if (o.type == "Lamb")
    p.ignore({{"max_coeff", "10.0"}, {"min_coeff", "0.01"}, {"eps_inside_sqrt", "false"}});
  p.finish(" (" + o.type + " takes: " + key_list(o) + ")");
  p.at_least("lr", o.lr, 0.0), p.at_least("eps", o.eps, 0.0);
  p.at_least("weight_decay", o.weight_decay, 0.0);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1))
    p.fail("betas", cat("must both be in [0, 1), got [", o.beta1, ", ", o.beta2, "]"));
  p.at_least("momentum", o.momentum, 0.0), p.at_least("dampening", o.dampening, 0.0);
  p.at_least("lr_decay", o.lr_decay, 0.0);
  p.at_least("initial_accumulator_value", o.initial_accumulator_value, 0.0);
  p.above("clamp_value", o.clamp_value, 0.0);
  p.at_least("min_8bit_size", o.min_8bit_size, int64_t{0});
  if (o.type == "Lamb" && o.amsgrad) p.fail("amsgrad", "is not supported by Lamb (DeepSpeed's FusedLamb)");
  if (o.amsgrad && (o.type == "Adam8bit" || o.type == "AdamW8bit" || o.type == "LAMB8bit"))
    p.fail("amsgrad", "is not supported by " + o.type + " (the 8-bit optimizers keep exp_avg and exp_avg_sq only)");
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    p.fail("nesterov", "needs momentum > 0 and dampening = 0 (torch.optim.SGD)");
  // DeepSpeed: the name AdamW forces decoupled decay (and bitsandbytes' AdamW8bit is AdamW).
  if (o.type == "AdamW" || o.type == "AdamW8bit") o.adam_w_mode = true;
}

void parse_scheduler(const json* j, ParseContext& ctx, SchedulerConfig& s) {
  ObjectReader r(j, "scheduler", ctx);
  r("type", s.type);
  const json* params = r.take("params");
  r.finish();
  if (s.type.empty()) {
    if (params) r.fail("type", "is required when 'scheduler.params' is given");
    return;
  }
  r.one_of("type", s.type, kSchedulers);
  ObjectReader p(params, "scheduler.params", ctx);
  visit(p, s);
  p.ignore({{"last_batch_iteration", "-1"}});
  p.finish(" (" + s.type + " takes: " + key_list(s) + ")");
  const std::string& t = s.type;
  if (t == "WarmupDecayLR" || t == "WarmupCosineLR") {
    if (!p.has("total_num_steps")) p.fail("total_num_steps", "is required for " + t);
    p.above("total_num_steps", s.total_num_steps, int64_t{0});
  }
  if (t == "OneCycle")
    for (const char* key : {"cycle_min_lr", "cycle_max_lr"})
      if (!p.has(key)) p.fail(key, "is required for OneCycle");
  p.at_least("warmup_min_lr", s.warmup_min_lr, 0.0), p.at_least("warmup_max_lr", s.warmup_max_lr, 0.0);
  p.at_least("warmup_num_steps", s.warmup_num_steps, int64_t{0});
  p.one_of("warmup_type", s.warmup_type, {"log", "linear"});
  p.unit_interval("warmup_min_ratio", s.warmup_min_ratio), p.unit_interval("cos_min_ratio", s.cos_min_ratio);
  p.at_least("cycle_min_lr", s.cycle_min_lr, 0.0), p.at_least("cycle_max_lr", s.cycle_max_lr, 0.0);
  p.above("cycle_first_step_size", s.cycle_first_step_size, int64_t{0});
  p.at_least("cycle_second_step_size", s.cycle_second_step_size.value_or(0), int64_t{0});
  p.at_least("cycle_first_stair_count", s.cycle_first_stair_count, int64_t{0});
  p.at_least("cycle_second_stair_count", s.cycle_second_stair_count.value_or(0), int64_t{0});
  p.at_least("decay_step_size", s.decay_step_size, int64_t{0});
  p.at_least("decay_lr_rate", s.decay_lr_rate, 0.0), p.at_least("decay_mom_rate", s.decay_mom_rate, 0.0);
  p.unit_interval("cycle_min_mom", s.cycle_min_mom), p.unit_interval("cycle_max_mom", s.cycle_max_mom);
  p.at_least("lr_range_test_min_lr", s.lr_range_test_min_lr, 0.0);
  p.above("lr_range_test_step_size", s.lr_range_test_step_size, int64_t{0});
  p.at_least("lr_range_test_step_rate", s.lr_range_test_step_rate, 0.0);
}

void parse_precision(const json* fp16, const json* bf16, const json* bfloat16, ParseContext& ctx,
                     Config& cfg) {
  ObjectReader r(fp16, "fp16", ctx);
  Fp16Config& c = cfg.fp16;
  visit(r, c);
  r.finish();
  r.at_least("loss_scale", c.loss_scale, 0.0);
  r.at_least("initial_scale_power", c.initial_scale_power, 0);
  if (c.initial_scale_power > 63) r.fail("initial_scale_power", cat("must be <= 63, got ", c.initial_scale_power));
  r.above("loss_scale_window", c.loss_scale_window, int64_t{0});
  r.above("hysteresis", c.hysteresis, 0), r.above("min_loss_scale", c.min_loss_scale, 0.0);
  if (bf16 && bfloat16) ctx.fail("'bf16' and 'bfloat16' (DeepSpeed's old name) are both given; keep 'bf16'");
  ObjectReader b(bf16 ? bf16 : bfloat16, bf16 ? "bf16" : "bfloat16", ctx);
  b("enabled", cfg.bf16.enabled);
  b.ignore({{"immediate_grad_update", "false"}});
  b.finish();
  if (bfloat16 && ctx.ignored)  // listed under the current name; config_to_json writes it there
    for (std::string& key : *ctx.ignored)
      if (key.rfind("bfloat16.", 0) == 0) key = "bf16." + key.substr(9);
  if (c.enabled && cfg.bf16.enabled) ctx.fail("'fp16.enabled' and 'bf16.enabled' are both true; pick one");
}

// A dtype as Apex's kwargs name it ("torch.float16", "half", ...) -> float16 | bfloat16 | float32;
// "" when it is none of them.
std::string amp_dtype_name(std::string v) {
  v = lower(v);
  if (v.rfind("torch.", 0) == 0) v = v.substr(6);
  if (v == "float16" || v == "half" || v == "fp16") return "float16";
  if (v == "bfloat16" || v == "bf16") return "bfloat16";
  if (v == "float32" || v == "float" || v == "fp32") return "float32";
  return "";
}

// DeepSpeed's `amp` block: {"enabled": ..., then amp.initialize's keyword arguments}. Apex's
// rules (apex/amp/frontend.py, Properties) are errors here as they are there.
void parse_amp(const json* j, ParseContext& ctx, Config& cfg) {
  ObjectReader r(j, "amp", ctx);
  AmpConfig& a = cfg.amp;
  r("enabled", a.enabled), r("opt_level", a.opt_level), r("dtype", a.dtype);
  r("min_loss_scale", a.min_loss_scale), r("max_loss_scale", a.max_loss_scale);
  r("num_losses", a.num_losses), r("verbosity", a.verbosity);
  const auto dtype_of = [&](const char* key, std::string& out) {
    const json* v = r.take(key);
    if (!v) return;  // null: the level's
    if (v->is_boolean() && !v->get<bool>()) {
      out = "none";
      return;
    }
    if (!v->is_string() || amp_dtype_name(v->get<std::string>()).empty())
      r.fail(key, "must be \"float16\", \"bfloat16\" or \"float32\" (torch.* spellings too), got " + describe(*v));
    out = amp_dtype_name(v->get<std::string>());
  };
  dtype_of("cast_model_type", a.cast_model_type);
  dtype_of("cast_model_outputs", a.cast_model_outputs);
  if (a.cast_model_outputs == "none") a.cast_model_outputs.clear();
  const auto flag = [&](const char* key, std::optional<bool>& out) {
    const json* v = r.take(key);
    if (!v) return;
    if (v->is_boolean()) out = v->get<bool>();
    else if (v->is_string() && (*v == "True" || *v == "False")) out = *v == "True";  // Apex accepts the strings
    else r.fail(key, "must be true, false or null, got " + describe(*v));
  };
  flag("patch_torch_functions", a.patch_torch_functions);
  flag("keep_batchnorm_fp32", a.keep_batchnorm_fp32);
  flag("master_weights", a.master_weights);
  if (const json* v = r.take("loss_scale")) {
    if (v->is_string() && *v == "dynamic") a.loss_scale = 0.0;
    else if (v->is_number() && v->get<double>() > 0 && std::isfinite(v->get<double>())) a.loss_scale = v->get<double>();
    else r.fail("loss_scale", "must be \"dynamic\" or a number > 0, got " + describe(*v));
  }
  r.finish();
  const std::string& level = a.opt_level;
  if (level != "O0" && level != "O1" && level != "O2" && level != "O3")
    r.fail("opt_level", "unexpected optimization level '" + level + "'; options are O0, O1, O2, O3" +
                            (level.size() == 2 && level[0] == '0' ? " (the prefix is the letter O, not the number zero)" : ""));
  if (!a.dtype.empty()) {
    const std::string d = amp_dtype_name(a.dtype);
    if (d != "float16" && d != "bfloat16") r.fail("dtype", "must be \"float16\" or \"bfloat16\", got \"" + a.dtype + "\"");
    a.dtype = d;
    if ((a.cast_model_type == "float16" || a.cast_model_type == "bfloat16") && a.cast_model_type != a.dtype)
      r.fail("cast_model_type", "is " + a.cast_model_type + " but amp.dtype is " + a.dtype + "; give one half type");
  }
  r.at_least("min_loss_scale", a.min_loss_scale, 0.0);  // 0 = none
  r.above("max_loss_scale", a.max_loss_scale, 0.0);
  if (a.min_loss_scale > a.max_loss_scale)
    r.fail("min_loss_scale", cat("(", a.min_loss_scale, ") is above max_loss_scale (", a.max_loss_scale, ")"));
  if (a.num_losses != 1)
    r.fail("num_losses", cat("polytrain's Trainer scales one loss per step (forward_step returns one); got ", a.num_losses));
  r.at_least("verbosity", a.verbosity, int64_t{0});
  // Apex's Properties rules.
  const bool o1 = level == "O1";
  if (o1 && !a.cast_model_type.empty() && a.cast_model_type != "none" && a.cast_model_type != "float32")
    r.fail("cast_model_type", "O1 inserts casts around torch functions rather than model weights, so the weights stay "
                              "fp32 with O1; to cast the model use opt_level O2 or O3 (Apex's rule)");
  if (!o1 && a.patch_torch_functions.value_or(false))
    r.fail("patch_torch_functions", "true only with opt_level O1 (Apex's rule)");
  if (o1 && a.keep_batchnorm_fp32)
    r.fail("keep_batchnorm_fp32", "with O1 normalization runs in fp32 anyway; leave it unset (Apex's rule)");
  if (o1 && a.master_weights)
    r.fail("master_weights", "with O1 the model weights themselves are fp32; leave it unset (Apex's rule)");
  if (!a.enabled) return;
  // DeepSpeed's rules (runtime/engine.py, runtime/config.py).
  if (cfg.fp16.enabled || cfg.bf16.enabled)
    ctx.fail(cat("'amp.enabled' and '", cfg.fp16.enabled ? "fp16" : "bf16",
                 ".enabled' are both true: cannot enable both amp with (legacy) fp16 or bfloat16 mode (DeepSpeed's rule); "
                 "amp.opt_level O1 is what fp16 does, with amp.dtype bfloat16 what bf16 does"));
  if (cfg.zero_optimization.stage > 0)
    ctx.fail(cat("'amp.enabled' with zero_optimization.stage ", cfg.zero_optimization.stage,
                 ": amp and ZeRO are not compatible (DeepSpeed's rule); use fp16 or bf16 with ZeRO"));
}

json write_amp(const AmpConfig& a) {
  const auto opt = [](const std::optional<bool>& v) { return v ? json(*v) : json(nullptr); };
  const auto str = [](const std::string& v) { return v.empty() ? json(nullptr) : json(v); };
  json out = {{"enabled", a.enabled},
              {"opt_level", a.opt_level},
              {"dtype", str(a.dtype)},
              {"cast_model_type", a.cast_model_type == "none" ? json(false) : str(a.cast_model_type)},
              {"patch_torch_functions", opt(a.patch_torch_functions)},
              {"keep_batchnorm_fp32", opt(a.keep_batchnorm_fp32)},
              {"master_weights", opt(a.master_weights)},
              {"loss_scale", !a.loss_scale ? json(nullptr) : *a.loss_scale == 0.0 ? json("dynamic") : json(*a.loss_scale)},
              {"cast_model_outputs", str(a.cast_model_outputs)},
              {"min_loss_scale", a.min_loss_scale},
              {"max_loss_scale", a.max_loss_scale},
              {"num_losses", a.num_losses},
              {"verbosity", a.verbosity}};
  return out;
}

void parse_offload(ObjectReader& zr, const char* key, ParseContext& ctx, ZeroOffloadConfig& o, bool param) {
  ObjectReader r(zr.take(key), zr.path_of(key), ctx);
  visit_offload(r, o, param);
  r.finish();
  r.one_of("device", o.device, {"none", "cpu", "nvme"});
  if (o.device == "nvme" && o.nvme_path.empty()) r.fail("nvme_path", "is required when device is nvme");
  r.at_least("buffer_count", o.buffer_count, int64_t{0});
  r.at_least("buffer_size", o.buffer_size, int64_t{0}), r.at_least("max_in_cpu", o.max_in_cpu, int64_t{0});
  r.unit_interval("ratio", o.ratio);
}

void parse_zero(const json* j, const json* allgather_size, ParseContext& ctx, ZeroConfig& z) {
  if (j && j->is_boolean()) {  // DeepSpeed's deprecated form: true = stage 1
    z.stage = j->get<bool>() ? 1 : 0;
    if (allgather_size) {
      json tmp = {{"allgather_size", *allgather_size}};
      ObjectReader a(&tmp, "", ctx);
      a("allgather_size", z.allgather_bucket_size);
    }
    return;
  }
  if (allgather_size && ctx.ignored) ctx.ignored->push_back("allgather_size");
  ObjectReader r(j, "zero_optimization", ctx);
  const bool overlap_given = r.has("overlap_comm");
  visit(r, z);
  if (!overlap_given) z.overlap_comm = z.stage == 3;  // DeepSpeed's dynamic default
  const bool optimizer_given = r.has("offload_optimizer"), param_given = r.has("offload_param");
  parse_offload(r, "offload_optimizer", ctx, z.offload_optimizer, false);
  parse_offload(r, "offload_param", ctx, z.offload_param, true);
  // Deprecated booleans, mapped as DeepSpeed maps them; not together with their replacement.
  bool cpu_offload = false, cpu_offload_param = false;
  r("cpu_offload", cpu_offload), r("cpu_offload_param", cpu_offload_param);
  if (r.has("cpu_offload") && optimizer_given)
    r.fail("cpu_offload", "is the deprecated form of 'offload_optimizer'; give only one of them");
  if (r.has("cpu_offload_param") && param_given)
    r.fail("cpu_offload_param", "is the deprecated form of 'offload_param'; give only one of them");
  if (cpu_offload) z.offload_optimizer.device = "cpu";
  if (cpu_offload_param) z.offload_param.device = "cpu";
  r.ignore(kZeroIgnored);
  r.finish();
  if (z.stage < 0 || z.stage > 3) r.fail("stage", cat("must be 0, 1, 2 or 3, got ", z.stage));
  r.above("reduce_bucket_size", z.reduce_bucket_size, int64_t{0});
  r.above("allgather_bucket_size", z.allgather_bucket_size, int64_t{0});
  if (z.allgather_bucket_size % 2 != 0)  // DeepSpeed's rule (its NCCL alignment factor is 2)
    r.fail("allgather_bucket_size", cat("must be even, got ", z.allgather_bucket_size));
  r.above("sub_group_size", z.sub_group_size, int64_t{0});
  r.at_least("stage3_max_live_parameters", z.stage3_max_live_parameters, int64_t{0});
  r.at_least("stage3_max_reuse_distance", z.stage3_max_reuse_distance, int64_t{0});
  r.at_least("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, int64_t{0});
  r.at_least("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, int64_t{0});
  if (z.offload_optimizer.ratio < 1.0 && z.stage != 3)
    r.fail("offload_optimizer", "ratio < 1 (partial offload) needs stage 3 (DeepSpeed's rule)");
  // Stage 3 reads these and does nothing with them: the optimizer steps every partition at once,
  // and the whole model is always gathered for an export. Named in the ignored-keys warning
  // when given.
  if (z.stage == 3 && ctx.ignored)
    for (const char* key : {"sub_group_size", "stage3_gather_16bit_weights_on_model_save"})
      if (r.has(key)) ctx.ignored->push_back(std::string("zero_optimization.") + key);
  if (z.offload_optimizer.ratio < 1.0 && ctx.ignored) ctx.ignored->push_back("zero_optimization.offload_optimizer.ratio");
}

void parse_model(const json* j, ParseContext& ctx, ModelConfig& m) {
  ObjectReader r(j, "model", ctx);
  r("model_type", m.model_type);
  r.one_of("model_type", m.model_type, {"bert", "roberta", "albert", "gpt2", "t5"});
  if (m.model_type != "bert" && m.model_type != "roberta") {
    // ALBERT, GPT-2, T5: their own HF config classes (models/<family>_config) read these keys.
    m.extra = r.rest();
    return;
  }
  if (m.model_type == "roberta") m.vocab_size = 50265, m.pad_token_id = 1;  // RobertaConfig's defaults
  visit(r, m);
  m.extra = r.rest();  // HF configs carry many more keys: kept, not errors
  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "max_position_embeddings", "type_vocab_size"})
    r.above(key, write(m)[key].get<int64_t>(), int64_t{0});
  if (m.hidden_size % m.num_attention_heads != 0)
    r.fail("hidden_size", cat("(", m.hidden_size, ") must be divisible by num_attention_heads (",
                              m.num_attention_heads, ")"));
  if (m.hidden_act.empty()) r.fail("hidden_act", "must not be empty");
  r.unit_interval("hidden_dropout_prob", m.hidden_dropout_prob, true);
  r.unit_interval("attention_probs_dropout_prob", m.attention_probs_dropout_prob, true);
  r.above("layer_norm_eps", m.layer_norm_eps, 0.0), r.at_least("initializer_range", m.initializer_range, 0.0);
  if (m.pad_token_id < 0 || m.pad_token_id >= m.vocab_size)
    r.fail("pad_token_id", cat("must be in [0, vocab_size = ", m.vocab_size, "), got ", m.pad_token_id));
}

void parse_data(const json* j, ParseContext& ctx, DataConfig& d, const ModelConfig& m) {
  ObjectReader r(j, "data", ctx);
  visit(r, d);
  r.finish();
  r.at_least("max_seq_length", d.max_seq_length, int64_t{8});
  if (m.model_type != "bert" && m.model_type != "roberta") return;  // checked when the model is built
  // RoBERTa numbers positions from pad_token_id + 1 (HF create_position_ids_from_input_ids).
  const int64_t limit = m.max_position_embeddings - (m.model_type == "roberta" ? m.pad_token_id + 1 : 0);
  if (d.max_seq_length > limit)
    r.fail("max_seq_length", cat("(", d.max_seq_length, ") exceeds what model.max_position_embeddings (",
                                 m.max_position_embeddings, ") allows for ", m.model_type, ": ", limit));
  r.unit_interval("eval_fraction", d.eval_fraction, true), r.unit_interval("mask_prob", d.mask_prob);
  r.unit_interval("random_replace_prob", d.random_replace_prob);
  r.unit_interval("unmask_replace_prob", d.unmask_replace_prob);
  if (d.random_replace_prob + d.unmask_replace_prob > 1.0)
    r.fail("random_replace_prob", cat("+ unmask_replace_prob must be <= 1, got ", d.random_replace_prob,
                                      " + ", d.unmask_replace_prob));
  r.at_least("eval_batches", d.eval_batches, int64_t{0});
}

// *read: every key was read (an unknown key may still follow), so the batch triple can use them.
void parse_trainer(const json* j, ParseContext& ctx, TrainerOptions& t, bool* read) {
  ObjectReader r(j, "trainer", ctx);
  visit(r, t);
  r.accept("fault_tolerance");  // no typed field: read and checked from the source (fault_tolerance_config.h)
  *read = true;
  r.finish();
  r.one_of("env_type", t.env_type, kEnvTypes);
  for (const char* key : {"epochs", "max_steps", "eval_interval", "log_interval", "save_interval",
                          "num_threads", "keep_last", "num_gpus", "num_nodes", "master_port"})
    r.at_least(key, write(t)[key].get<int64_t>(), int64_t{0});
  if (t.epochs == 0 && t.max_steps == 0) r.fail("epochs", "and max_steps are both 0: nothing to train");
  const std::string& dev = t.pytorch_device;
  const bool cuda_n = dev.rfind("cuda:", 0) == 0 && dev.size() > 5 &&
                      dev.find_first_not_of("0123456789", 5) == std::string::npos;
  if (dev != "cpu" && dev != "cuda" && !cuda_n)
    r.fail("pytorch_device", "must be cpu, cuda or cuda:N, got '" + dev + "'");
  if (t.experiments_dir.empty()) r.fail("experiments_dir", "must not be empty");
  r.one_of("comm_backend", t.comm_backend, {"auto", "gloo", "mpi", "nccl"});
  if (!(t.comm_timeout > 0)) r.fail("comm_timeout", "must be > 0 seconds");
  if (t.reduce_bucket_size < 1) r.fail("reduce_bucket_size", "must be >= 1 byte");
  if (t.experiment_name.empty()) r.fail("experiment_name", "must not be empty");
  if (t.master_port > 65535) r.fail("master_port", cat("must be a port number (0-65535), got ", t.master_port));
  // The world is not known here: resolve() checks the divisibility with the same rules.
  if (const std::string e = model_parallel_error(t.env_type, t.model_parallel_size, 0); !e.empty()) ctx.fail(e);
  if (const std::string e = pipeline_parallel_error(t.env_type, t.pipeline_parallel_size, t.model_parallel_size, 0);
      !e.empty())
    ctx.fail(e);
}

// DeepSpeed's `pipeline` block; `stages` ("auto" or a count) and trainer.pipeline_parallel_size
// name the same number, so both given must agree.
void parse_pipeline(const json* j, ParseContext& ctx, PipelineConfig& p) {
  ObjectReader r(j, "pipeline", ctx);
  visit(r, p);
  if (j && j->is_object() && j->contains("stages")) {
    const json& s = j->at("stages");
    if (s.is_string() && s.get<std::string>() == "auto") {
      r.accept("stages");
    } else {
      r("stages", p.stages);
      r.above("stages", p.stages, int64_t{0});
    }
  }
  r.ignore(kPipelineIgnored);
  r.finish();
  r.one_of("schedule", p.schedule, {"1f1b", "gpipe", "zbh1"});
  r.above("virtual_stages", p.virtual_stages, int64_t{0});
  r.at_least("activation_checkpoint_interval", p.activation_checkpoint_interval, int64_t{0});
  if (p.activation_checkpoint_interval > 1)
    r.fail("activation_checkpoint_interval", cat("is ", p.activation_checkpoint_interval, ": only 0 (off) and 1 (every "
                                                 "layer recomputed in backward) are supported"));
  if (const std::string e = pipeline_partition_error(p.partition); !e.empty()) r.fail("partition", e);
  if (p.virtual_stages > 1 && p.schedule != "1f1b")
    r.fail("virtual_stages", cat("(", p.virtual_stages, ") interleaves the 1f1b schedule; schedule '", p.schedule,
                                 "' has no interleaved form"));
}

// HOST:PORT with a port in [0, 65535] ([v6]:port allowed); the network layer resolves the host.
bool host_port_ok(const std::string& s) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size() || colon + 6 < s.size()) return false;
  for (size_t i = colon + 1; i < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  if (std::stol(s.substr(colon + 1)) > 65535) return false;
  for (size_t i = 0; i < colon; ++i)
    if (static_cast<unsigned char>(s[i]) <= ' ' || s[i] == 0x7f) return false;
  return true;
}

}  // namespace

std::vector<std::string> optimizer_statistics(const OptimizerConfig& cfg) {
  const OptimizerEntry* e = find_optimizer(cfg.type);
  return e ? e->statistics(cfg) : std::vector<std::string>{};
}

namespace {

void parse_hivemind(const json* j, ParseContext& ctx, HivemindConfig& h) {
  ObjectReader r(j, "hivemind", ctx);
  visit(r, h);
  r.accept("outer_optimizer");  // no typed field: read and checked from the source (outer_optimizer.h)
  r.finish();
  if (h.run_id.empty() || h.run_id.size() > 64 ||
      h.run_id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != std::string::npos)
    r.fail("run_id", "must be 1-64 characters of letters, digits, '_', '.', '-', got '" + h.run_id + "'");
  if (!host_port_ok(h.listen)) r.fail("listen", "must be HOST:PORT, got '" + h.listen + "'");
  if (!h.announce.empty() && !host_port_ok(h.announce)) r.fail("announce", "must be HOST:PORT, got '" + h.announce + "'");
  for (const auto& peer : h.initial_peers)
    if (!host_port_ok(peer)) r.fail("initial_peers", "entries must be HOST:PORT, got '" + peer + "'");
  r.at_least("target_batch_size", h.target_batch_size, int64_t{0});
  r.at_least("batch_size_lead", h.batch_size_lead, int64_t{0});
  if (h.target_batch_size > 0 && h.batch_size_lead >= h.target_batch_size)
    r.fail("batch_size_lead", cat("(", h.batch_size_lead, ") must be below hivemind.target_batch_size (",
                                  h.target_batch_size, "): a peer steps once the swarm has target_batch_size - "
                                  "batch_size_lead samples"));
  // Messages name matchmaking_time as the user wrote it (averaging_expiration is its alias).
  const std::string matchmaking = r.has("averaging_expiration") ? "averaging_expiration" : "matchmaking_time";
  for (const char* key : {"matchmaking_time", "averaging_timeout", "next_chunk_timeout", "request_timeout",
                          "bootstrap_timeout", "load_state_timeout"})
    if (!(write(h)[key].get<double>() > 0))
      r.fail(std::string(key) == "matchmaking_time" ? matchmaking : key, "must be > 0 seconds");
  r.at_least("allreduce_timeout", h.allreduce_timeout, 0.0);
  if (h.metadata_expiration < 11.0)
    r.fail("metadata_expiration", cat("must be >= 11 seconds (OpenDHT never completes shorter puts), got ",
                                      h.metadata_expiration));
  if (h.request_timeout >= h.matchmaking_time)
    r.fail("request_timeout", cat("(", h.request_timeout, " s) must be shorter than hivemind.", matchmaking, " (",
                                  h.matchmaking_time, " s): a leader must be able to answer before its group is due"));
  if (h.matchmaking_time >= h.averaging_timeout)
    r.fail(matchmaking, cat("(", h.matchmaking_time, " s) must be shorter than hivemind.averaging_timeout (",
                            h.averaging_timeout, " s)"));
  r.above("min_group_size", h.min_group_size, int64_t{0});
  if (h.target_group_size < h.min_group_size)
    r.fail("target_group_size", cat("(", h.target_group_size, ") is below hivemind.min_group_size (", h.min_group_size, ")"));
  // The swarm counts a declared bandwidth at most 1e6 (src/swarm/butterfly.h, kMaxDeclaredBandwidth).
  if (!(h.bandwidth > 0) || !(h.bandwidth <= 1e6)) r.fail("bandwidth", cat("must be in (0, 1e6], got ", h.bandwidth));
  if (h.assist_in_averaging && h.client_mode)
    r.fail("assist_in_averaging", "cannot be combined with hivemind.client_mode: an auxiliary peer reduces parts of "
                                  "the others' averages, so it must accept connections (hivemind's rule)");
  r.one_of("compression", h.compression, {"none", "fp16", "scaled_fp16", "uint8", "int4"});
  r.one_of("aggregation", h.aggregation, {"mean", "centered_clip"});
  if (!(h.centered_clip_tau > 0) || !std::isfinite(h.centered_clip_tau))
    r.fail("centered_clip_tau", cat("must be a finite number > 0, got ", h.centered_clip_tau));
  r.above("centered_clip_iterations", h.centered_clip_iterations, int64_t{0});
  r.at_least("average_state_every", h.average_state_every, int64_t{0});
  r.at_least("expected_peers", h.expected_peers, int64_t{0});
  r.at_least("num_streams", h.num_streams, int64_t{0});
  if (h.num_streams > 0 && (h.stream_index < 0 || h.stream_index >= h.num_streams))
    r.fail("stream_index", cat("must be in [0, num_streams = ", h.num_streams, "), got ", h.stream_index));
  if (h.num_streams == 0 && h.stream_index != 0)
    r.fail("stream_index", "is given without hivemind.num_streams");
  if (h.delay_optimizer_step && !h.offload_optimizer)
    r.fail("delay_optimizer_step", "needs hivemind.offload_optimizer: the background update steps the offloaded copy "
                                   "while the model computes (hivemind's rule)");
}

struct BatchKeys {
  std::optional<int64_t> train, micro, accum;  // null in JSON = not given (DeepSpeed's get())
};

BatchKeys read_batch_keys(ObjectReader& r) {
  BatchKeys k;
  r("train_batch_size", k.train), r("train_micro_batch_size_per_gpu", k.micro);
  r("gradient_accumulation_steps", k.accum);
  return k;
}

int64_t world_size_or_env(int64_t world_size) {
  if (world_size >= 1) return world_size;
  return read_dist_env().world_size;  // WORLD_SIZE, else Open MPI / PMI / Slurm, else 1
}

// The train_batch_size values nearest to `t` that `unit` divides, as "A or B" ("B" alone when A
// would be 0).
std::string nearest_multiples(int64_t t, int64_t unit) {
  const int64_t lo = t / unit * unit, hi = lo + unit;
  return lo > 0 ? cat(lo, " or ", hi) : cat(hi);
}

// A (micro, accumulation) pair whose product is `per_rank`, keeping the user's micro batch or
// accumulation when it divides, else one micro-batch per step.
std::pair<int64_t, int64_t> split_per_rank(int64_t per_rank, std::optional<int64_t> micro, std::optional<int64_t> accum) {
  if (micro && per_rank % *micro == 0) return {*micro, per_rank / *micro};
  if (accum && per_rank % *accum == 0) return {per_rank / *accum, *accum};
  return {per_rank, 1};
}

// What to write instead, for a triple that does not fit `ws` data-parallel ranks: the global batch
// the micro batch and accumulation give, and a micro batch and accumulation for the global batch
// given (or the nearest global batches the ranks divide).
std::string batch_fixes(std::optional<int64_t> t, std::optional<int64_t> m, std::optional<int64_t> g, int64_t ws,
                        const std::string& ws_name) {
  std::vector<std::string> ways;
  if (m) {
    const int64_t accum = g.value_or(1);
    ways.push_back(cat("train_batch_size ", *m * accum * ws, " (= train_micro_batch_size_per_gpu ", *m,
                       " x gradient_accumulation_steps ", accum, " x ", ws_name, " ", ws, ")"));
  }
  auto with_split = [&](int64_t total) {
    const auto [micro, accum] = split_per_rank(total / ws, m, g);
    return cat("train_batch_size ", total, " with train_micro_batch_size_per_gpu ", micro,
               " and gradient_accumulation_steps ", accum);
  };
  if (t && *t % ws == 0) {
    ways.push_back(with_split(*t));
  } else if (t) {
    const int64_t lo = *t / ws * ws;
    if (lo > 0) ways.push_back(with_split(lo));
    ways.push_back(with_split(lo + ws));
  }
  return cat("; values that work at ", ws_name, " ", ws, ": ", join(ways, ", or "));
}

// DeepSpeed's _set_batch_related_parameters + _batch_assertion. Where DeepSpeed floors a
// derived value and then fails the assertion, the message says what does not divide, and each
// message proposes values that work at this data-parallel size.
void resolve(BatchConfig& out, BatchKeys k, int64_t world_size, const TrainerOptions& trainer, const ParseContext& ctx) {
  const int64_t world = world_size_or_env(world_size);
  const int64_t model_parallel = trainer.model_parallel_size * trainer.pipeline_parallel_size;
  if (const std::string e = model_parallel_error(trainer.env_type, trainer.model_parallel_size, world); !e.empty())
    ctx.fail(e);
  if (const std::string e = pipeline_parallel_error(trainer.env_type, trainer.pipeline_parallel_size,
                                                    trainer.model_parallel_size, world);
      !e.empty())
    ctx.fail(e);
  // The data-parallel size: tensor-parallel peers and the stages of one pipeline share samples.
  const int64_t ws = world / model_parallel;
  const char* kT = "train_batch_size";
  const char* kM = "train_micro_batch_size_per_gpu";
  const char* kG = "gradient_accumulation_steps";
  const std::array<std::pair<const char*, std::optional<int64_t>>, 3> given = {
      {{kT, k.train}, {kM, k.micro}, {kG, k.accum}}};
  for (const auto& [name, v] : given)
    if (v && *v <= 0) ctx.fail(cat("'", name, "' must be > 0, got ", *v));
  const std::string ws_name = model_parallel == 1 ? "world_size" : "data-parallel size";
  const auto fixes = [&] { return batch_fixes(k.train, k.micro, k.accum, ws, ws_name); };
  auto derive = [&](const char* what, int64_t num, int64_t den, const std::string& den_text) {
    if (num % den != 0)
      ctx.fail(cat("cannot derive ", what, ": train_batch_size (", num, ") is not divisible by ", den_text,
                   "; values that work at ", ws_name, " ", ws, ": train_batch_size ", nearest_multiples(num, den)));
    return num / den;
  };
  auto& [t, m, g] = k;
  const std::string divisor = trainer.pipeline_parallel_size == 1 ? cat("model_parallel_size ", model_parallel)
                              : trainer.model_parallel_size == 1
                                  ? cat("pipeline_parallel_size ", model_parallel)
                                  : cat("(model_parallel_size ", trainer.model_parallel_size, " x pipeline_parallel_size ",
                                        trainer.pipeline_parallel_size, ")");
  const std::string ws_text = model_parallel == 1
                                  ? cat("world_size (", ws, ")")
                                  : cat("data-parallel size (", ws, " = world_size ", world, " / ", divisor, ")");
  if (t && m && g) {
  } else if (t && m) {
    g = derive(kG, *t, *m * ws, cat(kM, " (", *m, ") * ", ws_text));
  } else if (t && g) {
    m = derive(kM, *t, *g * ws, cat(kG, " (", *g, ") * ", ws_text));
  } else if (m && g) {
    t = *m * *g * ws;
  } else if (t) {
    g = 1, m = derive(kM, *t, ws, ws_text);
  } else if (m) {
    g = 1, t = *m * ws;
  } else {
    ctx.fail("no batch size given: pass --config FILE (configs/ has examples), or --train_batch_size N (global) or "
             "--batch_size N (per process); in a config file, give 'train_batch_size' or "
             "'train_micro_batch_size_per_gpu' (DeepSpeed needs one of them)");
  }
  if (*t != *m * *g * ws)
    ctx.fail(cat("batch sizes disagree: ", kT, " (", *t, ") != ", kM, " (", *m, ") * ", kG, " (", *g,
                 ") * ", ws_text, " = ", *m * *g * ws, fixes()));
  out = BatchConfig{*t, *m, *g, ws};
}

json::json_pointer pointer_of(const std::string& dotted) {
  std::string p = "/" + dotted;
  std::replace(p.begin(), p.end(), '.', '/');
  return json::json_pointer(p);
}

// The errors of one parse. Each step runs under run(): its InputError is recorded (each message
// once) and the next step still runs, so that one try reports every mistake of a config. A step
// that depends on another runs only when that one succeeded (its values may be half read).
class ErrorList {
 public:
  template <class Step>
  bool run(Step&& step) {
    try {
      step();
      return true;
    } catch (const InputError& e) {
      add(e.what());
      return false;
    }
  }
  void add(const std::string& message) {
    if (std::find(list_.begin(), list_.end(), message) == list_.end()) list_.push_back(message);
  }
  void throw_if_any() const {
    if (!list_.empty()) throw InputError(join(list_, "\n"));
  }

 private:
  std::vector<std::string> list_;
};

void check_swarm(const Config& cfg, const ParseContext& ctx) {
  if (const std::string e = swarm_batch_error(cfg); !e.empty()) ctx.fail(e);
  const auto kept = optimizer_statistics(cfg.optimizer);
  std::set<std::string> seen;
  for (const auto& s : cfg.hivemind.average_opt_statistics) {
    if (std::find(kept.begin(), kept.end(), s) == kept.end())
      ctx.fail(cat("hivemind.average_opt_statistics: '", s, "' is not a statistic of optimizer ", cfg.optimizer.type,
                   " (it keeps: ", kept.empty() ? "none" : join(kept, ", "), ")"));
    if (!seen.insert(s).second) ctx.fail(cat("hivemind.average_opt_statistics: '", s, "' is listed twice"));
  }
  if (cfg.batch.gradient_accumulation_steps != 1)
    ctx.fail(cat("gradient_accumulation_steps (", cfg.batch.gradient_accumulation_steps,
                 ") has no meaning under env_type 'hivemind': a peer accumulates micro-batches until the swarm "
                 "reaches hivemind.target_batch_size; set it to 1"));
}

}  // namespace

Config config_from_json(const json& doc, const std::string& origin, int64_t world_size) {
  return config_from_json_with(doc, origin, world_size, {});
}

Config config_from_json_with(const json& given, const std::string& origin, int64_t world_size,
                             std::vector<std::string> earlier) {
  Config cfg;
  ParseContext ctx{origin, &cfg.ignored_keys};
  ErrorList errors;
  const auto prefixed = [&](const std::string& m) { return origin.empty() ? m : origin + ": " + m; };
  for (const auto& e : earlier) errors.add(prefixed(e));
  json doc = given;
  std::vector<std::string> renamed;
  map_flagai_names(doc, &renamed);
  for (const auto& e : renamed) errors.add(prefixed(e));
  if (!errors.run([&] { ObjectReader(&doc, "", ctx); })) errors.throw_if_any();  // not an object: nothing to read
  ObjectReader top(&doc, "", ctx);
  cfg.source = given.is_null() ? json::object() : given;
  BatchKeys batch;
  bool top_ok = errors.run([&] { batch = read_batch_keys(top); });
  const json* optimizer = top.take("optimizer");
  const json* scheduler = top.take("scheduler");
  const json* fp16 = top.take("fp16");
  const json* bf16 = top.take("bf16");
  const json* bfloat16 = top.take("bfloat16");
  const json* amp = top.take("amp");
  const json* zero = top.take("zero_optimization");
  const json* allgather_size = top.take("allgather_size");
  const json* checkpointing = top.take("activation_checkpointing");
  const json* tensorboard = top.take("tensorboard");
  const json* csv_monitor = top.take("csv_monitor");
  const json* model = top.take("model");
  const json* data = top.take("data");
  const json* trainer = top.take("trainer");
  const json* hivemind = top.take("hivemind");
  const json* pipeline = top.take("pipeline");
  top_ok &= errors.run([&] {
    top("gradient_clipping", cfg.gradient_clipping), top("steps_per_print", cfg.steps_per_print);
    top("wall_clock_breakdown", cfg.wall_clock_breakdown);
    top.ignore(kTopLevelIgnored);
    top.finish();
  });
  errors.run([&] { top.at_least("gradient_clipping", cfg.gradient_clipping, 0.0); });
  errors.run([&] { top.above("steps_per_print", cfg.steps_per_print, int64_t{0}); });

  const bool optimizer_ok = errors.run([&] { parse_optimizer(optimizer, ctx, cfg.optimizer); });
  const bool scheduler_ok = errors.run([&] { parse_scheduler(scheduler, ctx, cfg.scheduler); });
  if (optimizer_ok && scheduler_ok && cfg.scheduler.type == "OneCycle" && cfg.scheduler.cycle_momentum) {
    const OptimizerEntry* e = find_optimizer(cfg.optimizer.type);
    if (e && !e->has_beta1)
      errors.add(prefixed(cat("scheduler.params.cycle_momentum: OneCycle cycles momentum (beta1), but optimizer '",
                              cfg.optimizer.type, "' has no beta1; set cycle_momentum to false or use Adam, AdamW or Lamb")));
  }
  const bool zero_ok = errors.run([&] { parse_zero(zero, allgather_size, ctx, cfg.zero_optimization); });
  const bool precision_ok = errors.run([&] { parse_precision(fp16, bf16, bfloat16, ctx, cfg); });
  if (precision_ok && zero_ok) errors.run([&] { parse_amp(amp, ctx, cfg); });
  if (precision_ok && zero_ok && cfg.fp16.enabled && cfg.fp16.fp16_master_weights_and_grads &&
      cfg.zero_optimization.stage != 2)
    errors.add(prefixed("'fp16.fp16_master_weights_and_grads' needs zero_optimization.stage 2 (DeepSpeed's rule)"));
  cfg.activation_checkpointing_present = checkpointing != nullptr;
  errors.run([&] {
    ObjectReader ac(checkpointing, "activation_checkpointing", ctx);
    visit(ac, cfg.activation_checkpointing);
    ac.finish();
    if (cfg.activation_checkpointing.number_checkpoints)
      ac.above("number_checkpoints", *cfg.activation_checkpointing.number_checkpoints, int64_t{0});
  });
  for (auto [j, name, out] : {std::tuple{tensorboard, "tensorboard", &cfg.tensorboard},
                              std::tuple{csv_monitor, "csv_monitor", &cfg.csv_monitor}})
    errors.run([&, j = j, name = name, out = out] {
      ObjectReader r(j, name, ctx);
      visit(r, *out);
      r.finish();
    });
  const bool model_ok = errors.run([&] { parse_model(model, ctx, cfg.model); });
  ModelConfig unknown_model;  // the data checks that need the model are left out
  unknown_model.model_type.clear();
  errors.run([&] { parse_data(data, ctx, cfg.data, model_ok ? cfg.model : unknown_model); });
  bool trainer_read = false;
  errors.run([&] { parse_trainer(trainer, ctx, cfg.trainer, &trainer_read); });
  // DeepSpeed's steps_per_print is its log interval; trainer.log_interval, when given, wins.
  if (doc.is_object() && doc.contains("steps_per_print") &&
      !(trainer && trainer->is_object() && trainer->contains("log_interval")))
    cfg.trainer.log_interval = cfg.steps_per_print;
  const bool hivemind_ok = errors.run([&] { parse_hivemind(hivemind, ctx, cfg.hivemind); });
  cfg.pipeline_present = pipeline != nullptr && !pipeline->is_null();
  const bool pipeline_ok = errors.run([&] { parse_pipeline(pipeline, ctx, cfg.pipeline); });
  if (pipeline_ok && trainer_read && cfg.pipeline.stages > 0) {
    const bool trainer_given = trainer && trainer->is_object() &&
                               (trainer->contains("pipeline_parallel_size") || trainer->contains("pipeline_model_parallel_size"));
    if (!trainer_given) {
      cfg.trainer.pipeline_parallel_size = cfg.pipeline.stages;
      errors.run([&] {
        if (const std::string e = pipeline_parallel_error(cfg.trainer.env_type, cfg.pipeline.stages,
                                                          cfg.trainer.model_parallel_size, 0);
            !e.empty())
          ctx.fail("pipeline.stages: " + e);
      });
    } else if (cfg.trainer.pipeline_parallel_size != cfg.pipeline.stages) {
      errors.add(prefixed(cat("pipeline.stages (", cfg.pipeline.stages, ") and trainer.pipeline_parallel_size (",
                              cfg.trainer.pipeline_parallel_size, ") disagree; give one of them")));
    }
  }
  // A swarm has no fixed world: the batch triple is this peer's own (world size 1).
  const bool swarm = cfg.trainer.env_type == "hivemind";
  // The triple needs readable batch keys (a misspelt one would read as missing) and the
  // trainer's env_type and model_parallel_size.
  const bool batch_ok = top_ok && trainer_read && errors.run([&] {
    resolve(cfg.batch, batch, swarm ? 1 : world_size, cfg.trainer, ctx);
  });
  if (swarm && batch_ok && hivemind_ok && optimizer_ok) errors.run([&] { check_swarm(cfg, ctx); });
  errors.throw_if_any();
  return cfg;
}

Config load_config(const std::string& path, int64_t world_size) {
  if (std::filesystem::is_directory(path)) throw InputError(path + ": is a directory, not a config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(cat(path, ": cannot read config file: ", std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  json doc = parse_json_strict(text.str(), path);
  // Paths resolve as in a run; whether the files are there is the run's check (build_config), so
  // that a config naming a dataset the user fetches later still loads.
  prepare_config_sources(doc, path, json::object());
  return config_from_json(doc, path, world_size);
}

std::string swarm_batch_error(const Config& cfg) {
  const int64_t target = cfg.hivemind.target_batch_size, micro = cfg.batch.train_micro_batch_size_per_gpu;
  if (target <= 0)
    return "hivemind.target_batch_size: env_type 'hivemind' needs the swarm's global batch (samples per global step "
           "over all peers), e.g. --target_batch_size 4096";
  if (target < micro)
    return cat("hivemind.target_batch_size (", target, ") is smaller than this peer's micro-batch "
               "train_micro_batch_size_per_gpu (", micro, ")");
  return "";
}

void resolve_batch(Config& cfg, const json& batch_source, int64_t world_size) {
  ParseContext ctx{"", nullptr};
  ObjectReader r(&batch_source, "", ctx);
  resolve(cfg.batch, read_batch_keys(r), world_size, cfg.trainer, ctx);
}

json config_to_json(const Config& in) {
  Config c = in;  // visit() takes mutable references
  json out = json::object();
  out["train_batch_size"] = c.batch.train_batch_size;
  out["train_micro_batch_size_per_gpu"] = c.batch.train_micro_batch_size_per_gpu;
  out["gradient_accumulation_steps"] = c.batch.gradient_accumulation_steps;
  out["optimizer"] = {{"type", c.optimizer.type}, {"params", write(c.optimizer)},
                      {"no_decay", c.optimizer.no_decay}};
  if (!c.scheduler.type.empty())
    out["scheduler"] = {{"type", c.scheduler.type}, {"params", write(c.scheduler)}};
  out["fp16"] = write(c.fp16);
  out["bf16"] = {{"enabled", c.bf16.enabled}};
  if (c.source.is_object() && c.source.contains("amp")) out["amp"] = write_amp(c.amp);
  out["gradient_clipping"] = c.gradient_clipping;
  out["steps_per_print"] = c.steps_per_print;
  out["wall_clock_breakdown"] = c.wall_clock_breakdown;
  json zero = write(c.zero_optimization);
  ObjectWriter offload_optimizer, offload_param;
  visit_offload(offload_optimizer, c.zero_optimization.offload_optimizer, false);
  visit_offload(offload_param, c.zero_optimization.offload_param, true);
  zero["offload_optimizer"] = offload_optimizer.out;
  zero["offload_param"] = offload_param.out;
  out["zero_optimization"] = zero;
  if (c.activation_checkpointing_present) out["activation_checkpointing"] = write(c.activation_checkpointing);
  if (c.pipeline_present) {
    out["pipeline"] = write(c.pipeline);
    out["pipeline"]["stages"] = c.pipeline.stages > 0 ? json(c.pipeline.stages) : json("auto");
  }
  out["tensorboard"] = write(c.tensorboard);
  out["csv_monitor"] = write(c.csv_monitor);
  json model = c.model.extra.is_object() ? c.model.extra : json::object();
  if (c.model.model_type == "bert" || c.model.model_type == "roberta") model.update(write(c.model));
  model["model_type"] = c.model.model_type;
  out["model"] = model;
  out["data"] = write(c.data);
  out["trainer"] = write(c.trainer);
  if (c.trainer.env_type == "hivemind" || (c.source.is_object() && c.source.contains("hivemind")))
    out["hivemind"] = write(c.hivemind);
  // Blocks no typed field holds, which their owners read from the source (outer_optimizer.h,
  // fault_tolerance_config.h): back verbatim.
  for (const auto& [section, key] : {std::pair<const char*, const char*>{"hivemind", "outer_optimizer"},
                                     std::pair<const char*, const char*>{"trainer", "fault_tolerance"}}) {
    if (c.source.is_object() && c.source.contains(section) && c.source[section].is_object() &&
        c.source[section].contains(key))
      out[section][key] = c.source[section][key];
  }
  // Ignored DeepSpeed keys go back verbatim, so the dump means to DeepSpeed what the input did.
  for (const std::string& path : c.ignored_keys) {
    json::json_pointer from = pointer_of(path);
    if (!c.source.contains(from) && path.rfind("bf16.", 0) == 0) from = pointer_of("bfloat16." + path.substr(5));
    if (c.source.contains(from)) out[pointer_of(path)] = c.source[from];
  }
  return out;
}

namespace config_detail {

std::vector<std::string> model_key_warnings(const json& model) {
  std::vector<std::string> out;
  if (!model.is_object()) return out;
  const std::string type = model.contains("model_type") && model["model_type"].is_string() ? model["model_type"].get<std::string>() : "bert";
  std::vector<std::string> known;
  if (type == "gpt2") known = kGpt2ConfigKeys;
  else if (type == "albert") known = kAlbertConfigKeys;
  else if (type == "t5") known = kT5ConfigKeys;
  else known = key_names(ModelConfig{});
  const auto listed = [](const std::vector<std::string>& list, const std::string& key) {
    return std::find(list.begin(), list.end(), key) != list.end();
  };
  for (const auto& item : model.items()) {
    const std::string& key = item.key();
    if (listed(known, key) || listed(kHfOtherConfigKeys, key)) continue;
    const std::string near = nearest(key, known);
    if (!near.empty()) out.push_back("model." + key + ": unknown key; did you mean " + near + "?");
  }
  return out;
}

}  // namespace config_detail

void warn_ignored_keys(const Config& cfg) {
  if (cfg.source.is_object() && cfg.source.contains("model"))
    for (const auto& line : model_key_warnings(cfg.source["model"])) std::fprintf(stderr, "warning: %s\n", line.c_str());
  if (cfg.ignored_keys.empty()) return;
  std::string list;
  for (const auto& key : cfg.ignored_keys) list += (list.empty() ? "" : ", ") + key;
  std::fprintf(stderr, "warning: DeepSpeed config keys polytrain does not implement are ignored: %s\n",
               list.c_str());
}

AmpPlan amp_plan(const AmpConfig& a) {
  AmpPlan p;
  if (!a.enabled) return p;
  p.enabled = true;
  // Apex's levels (apex/amp/frontend.py): O0 fp32; O1 patched functions (autocast), dynamic
  // scale; O2 half model, fp32 normalization, fp32 master weights, dynamic scale; O3 all half.
  const std::string& l = a.opt_level;
  std::string cast = l == "O0" ? "float32" : l == "O1" ? "" : "half";
  bool patch = l == "O1", keep = l == "O2", master = l == "O2";
  double scale = l == "O1" || l == "O2" ? 0.0 : 1.0;
  const bool half_given = a.cast_model_type == "float16" || a.cast_model_type == "bfloat16";
  p.half = !a.dtype.empty() ? a.dtype : half_given ? a.cast_model_type : "float16";
  if (!a.cast_model_type.empty()) cast = half_given ? "half" : a.cast_model_type;
  if (a.patch_torch_functions) patch = *a.patch_torch_functions;
  if (a.keep_batchnorm_fp32) keep = *a.keep_batchnorm_fp32;
  if (a.master_weights) master = *a.master_weights;
  if (a.loss_scale) scale = *a.loss_scale;
  p.autocast = patch;
  p.cast_model = cast == "half";
  p.keep_norm_fp32 = p.cast_model && keep;
  p.master_weights = p.cast_model && master;  // fp32 copies of fp32 weights would change nothing
  p.loss_scale = scale;
  p.min_loss_scale = a.min_loss_scale;
  p.max_loss_scale = a.max_loss_scale;
  p.outputs = !a.cast_model_outputs.empty() ? a.cast_model_outputs : p.cast_model ? "float32" : "";
  return p;
}

}  // namespace polytrain
