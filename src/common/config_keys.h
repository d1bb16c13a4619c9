// How config.cpp reads and writes JSON: the known-key tables (one visit() list of (key, field)
// per section, used by both the strict ObjectReader and its mirror ObjectWriter, plus the DeepSpeed
// keys accepted but not implemented), type/range errors that name the JSON path, and suggestions.
// What the sections mean, their defaults and cross-field rules stay in config.cpp.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain::config_detail {

using nlohmann::json;

/// The known name nearest to `key` (case-insensitive; a cut-short name counts as one edit), or ""
/// when none is near: at most a third of the typed name changed (at least one edit allowed).
std::string nearest(const std::string& key, const std::vector<std::string>& known);

/// " (did you mean 'x'?)" for the known name nearest to `key`, or "" when none is near.
std::string suggest(const std::string& key, const std::vector<std::string>& known);

/// A JSON value for a message: its type and, for scalars, the value (`string "abc"`).
std::string describe(const json& v);

/// Line (1-based) of the first key that repeats inside one object of `text`, 0 if none.
/// Mirrors the parser's walk so the line matches the key the parser callback rejected.
int duplicate_key_line(const std::string& text);

/// A key DeepSpeed knows that polytrain accepts without implementing it. `default_json` is
/// DeepSpeed's default (a value equal to it is not reported); nullptr marks a block, reported
/// unless it is null, false or `{"enabled": false}`.
struct IgnoredKey {
  const char* name;
  const char* default_json;
};

// DeepSpeed keys (deepspeed/runtime/constants.py, config.py and the modules it reads) that
// polytrain accepts and does not implement, with DeepSpeed's default.
inline const std::vector<IgnoredKey> kTopLevelIgnored = {
    {"communication_data_type", "null"},
    {"seq_parallel_comm_data_type", "\"fp32\""},
    {"seq_parallel_communication_data_type", "\"fp32\""},
    {"prescale_gradients", "false"},
    {"gradient_predivide_factor", "1.0"},
    {"sparse_gradients", "false"},
    {"disable_allgather", "false"},
    {"dump_state", "false"},
    {"memory_breakdown", "false"},
    {"zero_allow_untested_optimizer", "false"},
    {"zero_force_ds_cpu_optimizer", "true"},
    {"graph_harvesting", "false"},
    {"dataloader_drop_last", "false"},
    {"use_data_before_expert_parallelism", "false"},
    {"vocabulary_size", "null"},
    {"sparse_attention", nullptr},
    {"eigenvalue", nullptr},
    {"progressive_layer_drop", nullptr},
    {"quantize_training", nullptr},
    {"compression_training", nullptr},
    {"weight_quantization", nullptr},
    {"data_efficiency", nullptr},
    {"curriculum_learning", nullptr},
    {"elasticity", nullptr},
    {"autotuning", nullptr},
    {"checkpoint", nullptr},
    {"data_types", nullptr},
    {"aio", nullptr},
    {"flops_profiler", nullptr},
    {"comms_logger", nullptr},
    {"wandb", nullptr},
    {"comet", nullptr},
    {"nebula", nullptr},
    {"timers", nullptr},
    {"tensor_parallel", nullptr},
    {"hybrid_engine", nullptr},
};

// DeepSpeedZeroConfig fields (runtime/zero/config.py) without a ZeroConfig member.
inline const std::vector<IgnoredKey> kZeroIgnored = {
    {"use_multi_rank_bucket_allreduce", "true"},
    {"load_from_fp32_weights", "true"},
    {"stage3_model_persistence_threshold", "9223372036854775807"},
    {"model_persistence_threshold", "9223372036854775807"},
    {"stage3_module_granularity_threshold", "0"},
    {"module_granularity_threshold", "0"},
    {"stage3_use_all_reduce_for_fetch_params", "false"},
    {"use_all_reduce_for_fetch_params", "false"},
    {"zero_hpz_partition_size", "1"},
    {"zero_quantized_weights", "false"},
    {"zero_quantized_nontrainable_weights", "false"},
    {"zero_quantized_gradients", "false"},
    {"zeropp_loco_param", "null"},
    {"mics_shard_size", "-1"},
    {"mics_hierarchical_params_gather", "false"},
    {"memory_efficient_linear", "true"},
    {"pipeline_loading_checkpoint", "false"},
    {"override_module_apply", "true"},
    {"log_trace_cache_warnings", "false"},
    {"grad_hooks", "true"},
    {"cpu_offload_use_pin_memory", "false"},  // deprecated; a no-op in DeepSpeed too
};

/// A string that JSON may give as null (DeepSpeed's Optional[str] / Optional[Path]); null <-> "".
struct NullableString {
  std::string& value;
};

/// What every reader of one document shares: the file name for messages and the ignored keys.
struct ParseContext {
  std::string origin;                         ///< "" = no `origin: ` prefix in messages
  std::vector<std::string>* ignored = nullptr;
  [[noreturn]] void fail(const std::string& message) const;
};

/// Reads one JSON object strictly. Each key read, taken or ignored becomes known; finish() turns
/// every other key into an InputError naming its path. A null or absent object reads as {}.
class ObjectReader {
 public:
  ObjectReader(const json* obj, std::string path, ParseContext& ctx);

  /// Reads `key` (or one of its aliases; giving two of them is an error) into `v` when present.
  void operator()(const char* key, bool& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, int& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, int64_t& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, uint64_t& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, double& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, std::string& v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, NullableString v, std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, std::vector<std::string>& v,
                  std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, std::optional<int64_t>& v,
                  std::initializer_list<const char*> aliases = {});
  void operator()(const char* key, std::optional<bool>& v, std::initializer_list<const char*> aliases = {});
  /// A two-number array such as Adam's `betas`.
  void pair(const char* key, double& first, double& second);

  bool has(const char* key) const;
  /// Marks `key` known and returns its value (nullptr when absent or null).
  const json* take(const char* key);
  /// Marks the table's keys known; records the present ones that differ from DeepSpeed's default.
  void ignore(const std::vector<IgnoredKey>& table);
  /// Marks `key` known, with no effect (accepted for DeepSpeed compatibility).
  void accept(const char* key) { known_.insert(key); }
  /// InputError for the first key nobody read; `note` is added when no near key is found.
  void finish(const std::string& note = "") const;
  /// The keys nobody read, verbatim (the `model` section keeps them).
  json rest() const;

  std::string path_of(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;
  // Range checks: the message names the key and the value.
  template <typename T>
  void at_least(const char* key, T v, T lo) const {
    if (!(v >= lo)) fail(key, ::polytrain::detail::cat("must be >= ", lo, ", got ", v));
  }
  template <typename T>
  void above(const char* key, T v, T lo) const {
    if (!(v > lo)) fail(key, ::polytrain::detail::cat("must be > ", lo, ", got ", v));
  }
  void unit_interval(const char* key, double v, bool open_high = false) const;
  void one_of(const char* key, const std::string& v, const std::vector<std::string>& options) const;

 private:
  const json* find_one(const char* key, std::initializer_list<const char*> aliases,
                       std::string* used);
  [[noreturn]] void type_error(const std::string& key, const json& v, const char* expected) const;

  const json* obj_;
  std::string path_;
  ParseContext& ctx_;
  std::set<std::string> known_;
};

/// The mirror of ObjectReader: the same visit function fills `out`, every key written.
class ObjectWriter {
 public:
  template <typename T>
  void operator()(const char* key, const T& v, std::initializer_list<const char*> = {}) {
    out[key] = v;
  }
  void operator()(const char* key, const std::optional<int64_t>& v,
                  std::initializer_list<const char*> = {}) {
    out[key] = v ? json(*v) : json(nullptr);
  }
  void operator()(const char* key, const std::optional<bool>& v, std::initializer_list<const char*> = {}) {
    out[key] = v ? json(*v) : json(nullptr);
  }
  void operator()(const char* key, NullableString v, std::initializer_list<const char*> = {}) {
    out[key] = v.value.empty() ? json(nullptr) : json(v.value);
  }
  void pair(const char* key, double first, double second) { out[key] = {first, second}; }
  json out = json::object();
};

// ---- (key, field) lists: ObjectReader reads them, ObjectWriter writes them ------------------

// Keys per optimizer type, as DeepSpeed hands them to FusedAdam / FusedLamb / torch.optim.
template <class V>
void visit(V& v, OptimizerConfig& o) {
  v("lr", o.lr);
  if (o.type == "SGD") {
    v("momentum", o.momentum), v("dampening", o.dampening), v("weight_decay", o.weight_decay);
    v("nesterov", o.nesterov);
    return;
  }
  v("eps", o.eps), v("weight_decay", o.weight_decay);
  if (o.type == "Adagrad") {
    v("lr_decay", o.lr_decay), v("initial_accumulator_value", o.initial_accumulator_value);
    return;
  }
  v.pair("betas", o.beta1, o.beta2);
  v("amsgrad", o.amsgrad);
  if (o.type == "Adam8bit" || o.type == "AdamW8bit" || o.type == "LAMB8bit")
    v("min_8bit_size", o.min_8bit_size), v("keep_32bit_state", o.keep_32bit_state);
  if (o.type == "Lamb" || o.type == "LAMB8bit") {
    v("bias_correction", o.bias_correction, {"debias"}), v("clamp_value", o.clamp_value);
  } else {
    v("bias_correction", o.bias_correction), v("adam_w_mode", o.adam_w_mode);
    if (o.type == "Adam" || o.type == "AdamW") v("fused", o.fused), v("foreach", o.foreach);  // libtorch's only
  }
}

// Keys per schedule type: the keyword arguments of deepspeed/runtime/lr_schedules.py.
template <class V>
void visit(V& v, SchedulerConfig& s) {
  const std::string& t = s.type;
  if (t == "WarmupLR" || t == "WarmupDecayLR") {
    v("warmup_min_lr", s.warmup_min_lr), v("warmup_max_lr", s.warmup_max_lr);
  } else if (t == "WarmupCosineLR") {
    v("warmup_min_ratio", s.warmup_min_ratio), v("cos_min_ratio", s.cos_min_ratio);
  }
  if (t == "WarmupLR" || t == "WarmupDecayLR" || t == "WarmupCosineLR") {
    v("warmup_num_steps", s.warmup_num_steps), v("warmup_type", s.warmup_type);
    if (t != "WarmupLR") v("total_num_steps", s.total_num_steps);
  } else if (t == "OneCycle") {
    v("cycle_min_lr", s.cycle_min_lr), v("cycle_max_lr", s.cycle_max_lr);
    v("decay_lr_rate", s.decay_lr_rate), v("cycle_first_step_size", s.cycle_first_step_size);
    v("cycle_second_step_size", s.cycle_second_step_size);
    v("cycle_first_stair_count", s.cycle_first_stair_count);
    v("cycle_second_stair_count", s.cycle_second_stair_count);
    v("decay_step_size", s.decay_step_size), v("cycle_momentum", s.cycle_momentum);
    v("cycle_min_mom", s.cycle_min_mom), v("cycle_max_mom", s.cycle_max_mom);
    v("decay_mom_rate", s.decay_mom_rate);
  } else if (t == "LRRangeTest") {
    v("lr_range_test_min_lr", s.lr_range_test_min_lr);
    v("lr_range_test_step_size", s.lr_range_test_step_size);
    v("lr_range_test_step_rate", s.lr_range_test_step_rate);
    v("lr_range_test_staircase", s.lr_range_test_staircase);
  }
}

template <class V>
void visit(V& v, Fp16Config& c) {
  v("enabled", c.enabled), v("auto_cast", c.auto_cast), v("loss_scale", c.loss_scale);
  v("initial_scale_power", c.initial_scale_power), v("loss_scale_window", c.loss_scale_window);
  v("hysteresis", c.hysteresis), v("consecutive_hysteresis", c.consecutive_hysteresis);
  v("min_loss_scale", c.min_loss_scale);
  v("fp16_master_weights_and_grads", c.fp16_master_weights_and_grads);
}

// DeepSpeedZeroOffloadParamConfig (param) / DeepSpeedZeroOffloadOptimizerConfig.
template <class V>
void visit_offload(V& v, ZeroOffloadConfig& o, bool param) {
  v("device", o.device), v("nvme_path", NullableString{o.nvme_path});
  v("buffer_count", o.buffer_count), v("pin_memory", o.pin_memory);
  if (param) {
    v("buffer_size", o.buffer_size), v("max_in_cpu", o.max_in_cpu);
  } else {
    v("pipeline_read", o.pipeline_read), v("pipeline_write", o.pipeline_write);
    v("fast_init", o.fast_init), v("ratio", o.ratio);
  }
}

// DeepSpeedZeroConfig; the stage3_ names are pydantic aliases, DeepSpeed accepts both.
template <class V>
void visit(V& v, ZeroConfig& z) {
  v("stage", z.stage), v("contiguous_gradients", z.contiguous_gradients);
  v("overlap_comm", z.overlap_comm), v("reduce_scatter", z.reduce_scatter);
  v("reduce_bucket_size", z.reduce_bucket_size), v("allgather_partitions", z.allgather_partitions);
  v("allgather_bucket_size", z.allgather_bucket_size);
  v("round_robin_gradients", z.round_robin_gradients);
  v("elastic_checkpoint", z.elastic_checkpoint), v("sub_group_size", z.sub_group_size);
  v("stage3_max_live_parameters", z.stage3_max_live_parameters, {"max_live_parameters"});
  v("stage3_max_reuse_distance", z.stage3_max_reuse_distance, {"max_reuse_distance"});
  v("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, {"prefetch_bucket_size"});
  v("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold,
    {"param_persistence_threshold"});
  v("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save,
    {"gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"});
  v("ignore_unused_parameters", z.ignore_unused_parameters), v("legacy_stage1", z.legacy_stage1);
}

template <class V>
void visit(V& v, ActivationCheckpointingConfig& c) {
  v("partition_activations", c.partition_activations), v("cpu_checkpointing", c.cpu_checkpointing);
  v("contiguous_memory_optimization", c.contiguous_memory_optimization);
  v("number_checkpoints", c.number_checkpoints);
  v("synchronize_checkpoint_boundary", c.synchronize_checkpoint_boundary), v("profile", c.profile);
}

template <class V>
void visit(V& v, PipelineConfig& c) {
  v("partition", c.partition, {"partition_method"});
  v("activation_checkpoint_interval", c.activation_checkpoint_interval);
  v("virtual_stages", c.virtual_stages, {"virtual_pipeline_model_parallel_size"});
  v("schedule", c.schedule);
}

// DeepSpeed `pipeline` keys without an effect here (its PipelineEngine's communication options).
inline const std::vector<IgnoredKey> kPipelineIgnored = {
    {"seed_layers", "false"},
    {"pipe_partitioned", "true"},
    {"grad_partitioned", "true"},
    {"use_reentrant", "true"},
};

template <class V>
void visit(V& v, MonitorConfig& c) {
  v("enabled", c.enabled), v("output_path", c.output_path), v("job_name", c.job_name);
}

template <class V>
void visit(V& v, DataConfig& d) {
  v("train_files", d.train_files), v("vocab_file", d.vocab_file);
  v("max_seq_length", d.max_seq_length), v("eval_fraction", d.eval_fraction);
  v("mask_prob", d.mask_prob), v("random_replace_prob", d.random_replace_prob);
  v("unmask_replace_prob", d.unmask_replace_prob), v("whole_word_mask", d.whole_word_mask);
  v("eval_batches", d.eval_batches);
}

template <class V>
void visit(V& v, TrainerOptions& t) {
  v("env_type", t.env_type), v("epochs", t.epochs), v("max_steps", t.max_steps);
  v("eval_interval", t.eval_interval), v("log_interval", t.log_interval);
  v("save_interval", t.save_interval), v("save_dir", t.save_dir), v("load_dir", t.load_dir);
  v("experiments_dir", t.experiments_dir), v("experiment_name", t.experiment_name);
  v("exp_type", t.exp_type), v("seed", t.seed), v("pytorch_device", t.pytorch_device), v("tf32", t.tf32);
  v("num_threads", t.num_threads), v("checkpoint_activations", t.checkpoint_activations);
  v("save_safetensors", t.save_safetensors), v("keep_last", t.keep_last);
  v("progress_bar", t.progress_bar), v("comm_backend", t.comm_backend), v("comm_timeout", t.comm_timeout);
  v("reduce_bucket_size", t.reduce_bucket_size), v("overlap_comm", t.overlap_comm);
  v("find_unused_parameters", t.find_unused_parameters);
  v("model_parallel_size", t.model_parallel_size, {"tensor_model_parallel_size"});
  v("pipeline_parallel_size", t.pipeline_parallel_size, {"pipeline_model_parallel_size"});
  v("num_gpus", t.num_gpus), v("num_nodes", t.num_nodes), v("hostfile", t.hostfile);
  v("master_ip", t.master_ip, {"master_addr"}), v("master_port", t.master_port);
  v("training_script", t.training_script);
}

template <class V>
void visit(V& v, HivemindConfig& h) {
  v("run_id", h.run_id), v("listen", h.listen), v("announce", h.announce), v("initial_peers", h.initial_peers);
  v("target_batch_size", h.target_batch_size), v("batch_size_lead", h.batch_size_lead);
  // averaging_expiration: CollaborativeOptimizer's name (DecentralizedAverager's deprecated
  // alias of min_matchmaking_time, which hivemind.Optimizer's matchmaking_time sets).
  v("matchmaking_time", h.matchmaking_time, {"averaging_expiration"});
  v("averaging_timeout", h.averaging_timeout), v("allreduce_timeout", h.allreduce_timeout);
  v("next_chunk_timeout", h.next_chunk_timeout), v("request_timeout", h.request_timeout);
  v("bootstrap_timeout", h.bootstrap_timeout), v("metadata_expiration", h.metadata_expiration);
  v("load_state_timeout", h.load_state_timeout);
  v("min_group_size", h.min_group_size), v("target_group_size", h.target_group_size);
  v("client_mode", h.client_mode), v("assist_in_averaging", h.assist_in_averaging);
  v("bandwidth", h.bandwidth), v("compression", h.compression);
  v("aggregation", h.aggregation), v("centered_clip_tau", h.centered_clip_tau);
  v("centered_clip_iterations", h.centered_clip_iterations);
  v("average_state_every", h.average_state_every), v("average_opt_statistics", h.average_opt_statistics);
  v("offload_optimizer", h.offload_optimizer);
  v("delay_optimizer_step", h.delay_optimizer_step), v("identity_path", h.identity_path);
  v("expected_peers", h.expected_peers), v("num_streams", h.num_streams), v("stream_index", h.stream_index);
}

/// FlagAI's Trainer argument names given in `trainer` moved, in `doc`, to the DeepSpeed keys they
/// mean (config_flagai.cpp; docs/config.md, "FlagAI names"). A name whose DeepSpeed key is given
/// too with another value is a conflict: with `errors`, it is appended there (naming both keys)
/// and the FlagAI key dropped; without, both are left for a later call to report. `warm_up`
/// needs the run's length, so only a call with `errors` (the whole config) maps it.
void map_flagai_names(json& doc, std::vector<std::string>* errors);

/// One line per `model` key that no reader of `model`'s family knows but that is one typo away
/// from a known key: "model.n_layers: unknown key; did you mean n_layer?". Other unknown keys
/// are Hugging Face's many and stay silent.
std::vector<std::string> model_key_warnings(const json& model);

template <class T>
json write(T& section) {
  ObjectWriter w;
  visit(w, section);
  return w.out;
}

template <class T>
std::vector<std::string> key_names(T section) {
  std::vector<std::string> out;
  const json keys = write(section);  // items() of a temporary would dangle
  for (const auto& item : keys.items()) out.push_back(item.key());
  return out;
}

template <class T>
std::string key_list(T section) {
  std::string out;
  const json keys = write(section);
  for (const auto& item : keys.items()) out += (out.empty() ? "" : ", ") + item.key();
  return out;
}

}  // namespace polytrain::config_detail
