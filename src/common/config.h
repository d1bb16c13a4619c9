// The typed config tree: a DeepSpeed JSON file plus polytrain's `trainer`, `model` and `data`
// sections, parsed and validated once (parse_config). Each component receives only its
// sub-struct. Parsing/validation live in config.cpp; nothing here includes torch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/models/bert_config.h"  // ModelConfig, the `model` section (BERT/RoBERTa)

namespace polytrain {

/// DeepSpeed's batch triple, resolved with DeepSpeed's fill-in rules at the data-parallel size
/// (world size / trainer.model_parallel_size, as DeepSpeed does under model parallelism).
struct BatchConfig {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  /// The data-parallel size the triple was resolved at; the Trainer refuses to run when the
  /// backend's data-parallel size differs (the global batch would silently shrink or grow).
  int64_t world_size = 1;
};

/// `optimizer {type, params}`. Names follow DeepSpeed / torch.optim.
struct OptimizerConfig {
  /// Adam, AdamW, CPUAdam, Lamb, Adam8bit, AdamW8bit, LAMB8bit, SGD, Adagrad (the registry's,
  /// optim/optimizer_registry.h; case-insensitive in JSON)
  std::string type = "AdamW";
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;     ///< DeepSpeed "Adam": decoupled decay unless adam_w_mode=false
  bool bias_correction = true; ///< Adam/AdamW/Lamb (Lamb: `debias`)
  double clamp_value = 10.0;   ///< Lamb trust-ratio clamp (torch_optimizer / hivemind)
  bool amsgrad = false;
  /// Adam/AdamW, as torch.optim's: `fused` one kernel for all parameters (at::_fused_adamw_,
  /// LibTorch >= 2.0), `foreach` a few multi-tensor kernels (any LibTorch, any device), neither:
  /// libtorch's per-parameter loop. Unset (null): fused for CUDA parameters where LibTorch has
  /// it, else foreach on CUDA, the per-parameter loop on the CPU.
  std::optional<bool> fused, foreach;
  double momentum = 0.0;       ///< SGD
  double dampening = 0.0;      ///< SGD
  bool nesterov = false;       ///< SGD
  double lr_decay = 0.0;       ///< Adagrad
  double initial_accumulator_value = 0.0;  ///< Adagrad
  /// Adam8bit / AdamW8bit / LAMB8bit (bitsandbytes' semantics): a parameter with fewer
  /// elements than min_8bit_size keeps 32-bit state (bitsandbytes' default 4096), and so does one
  /// whose name contains any of keep_32bit_state (the embeddings by default: the 8-bit paper
  /// trains language models with a StableEmbedding, whose state stays 32-bit).
  int64_t min_8bit_size = 4096;
  std::vector<std::string> keep_32bit_state = {"embed", "wte", "wpe", "shared"};
  /// Parameter names matching any of these substrings get no weight decay.
  std::vector<std::string> no_decay = {"bias", "LayerNorm", "layer_norm", "ln_"};
};

/// The per-parameter statistics `cfg`'s optimizer keeps, by the names torch.optim's state uses:
/// Adam/AdamW/Lamb/CPUAdam and the 8-bit ones exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad); SGD
/// momentum_buffer (momentum > 0); Adagrad sum.
std::vector<std::string> optimizer_statistics(const OptimizerConfig& cfg);

/// `scheduler {type, params}` with DeepSpeed's parameter names and defaults.
struct SchedulerConfig {
  std::string type;  ///< "" = constant lr; WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest
  // WarmupLR / WarmupDecayLR
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  ///< "log" or "linear"
  int64_t total_num_steps = 0;       ///< WarmupDecayLR, WarmupCosineLR (required there)
  // WarmupCosineLR
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  std::optional<int64_t> cycle_second_step_size;  ///< defaults to cycle_first_step_size
  int64_t cycle_first_stair_count = 0;
  std::optional<int64_t> cycle_second_stair_count;  ///< defaults to cycle_first_stair_count
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest
  double lr_range_test_min_lr = 0.001;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

/// `fp16` block (DeepSpeed semantics; loss_scale 0 = dynamic).
struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool fp16_master_weights_and_grads = false;  ///< DeepSpeed: only with ZeRO stage 2
};

/// `bf16` block.
struct Bf16Config {
  bool enabled = false;
};

/// `amp` block: NVIDIA Apex's amp.initialize arguments, as DeepSpeed hands them over
/// ({"enabled": true, "opt_level": "O2", ...}). Unset properties take the level's value
/// (amp_plan). `dtype` is polytrain's: the half type (float16 needs CUDA; bfloat16 runs on CPU).
struct AmpConfig {
  bool enabled = false;
  std::string opt_level = "O1";                ///< O0, O1, O2, O3
  std::string dtype;                           ///< "" = cast_model_type's half type, else float16
  std::string cast_model_type;                 ///< "" = the level's; float16, bfloat16, float32 or "none"
  std::optional<bool> patch_torch_functions;   ///< autocast around the forward
  std::optional<bool> keep_batchnorm_fp32;     ///< normalization layers stay fp32 in a half model
  std::optional<bool> master_weights;          ///< fp32 copies the optimizer updates
  std::optional<double> loss_scale;            ///< 0 = "dynamic"
  std::string cast_model_outputs;              ///< "" = float32 when the model is cast, else as is
  double min_loss_scale = 0.0;                 ///< 0 = none (Apex's None)
  double max_loss_scale = 16777216.0;          ///< 2^24, Apex's default
  int64_t num_losses = 1;
  int64_t verbosity = 1;
};

/// What an `amp` block means once the level's defaults are applied (Apex's Properties).
struct AmpPlan {
  bool enabled = false;
  std::string half = "float16";  ///< float16 or bfloat16
  bool autocast = false;         ///< patch_torch_functions: the forward runs under autocast
  bool cast_model = false;       ///< trainable weights in `half` (O2, O3)
  bool keep_norm_fp32 = false;   ///< ... except normalization layers
  bool master_weights = false;   ///< the optimizer updates fp32 copies (O2)
  double loss_scale = 1.0;       ///< 0 = dynamic (from 2^16, window 2000, no hysteresis: Apex's)
  double min_loss_scale = 0.0;   ///< 0 = none
  double max_loss_scale = 16777216.0;
  std::string outputs;           ///< the model outputs' dtype ("" = as computed)
};

/// The plan for `amp` (validated by config_from_json: any combination it accepts has one).
AmpPlan amp_plan(const AmpConfig& amp);

/// `zero_optimization` block: all keys parsed and validated now; used by the deepspeed backend.
struct ZeroOffloadConfig {
  std::string device = "none";  ///< none, cpu, nvme
  bool pin_memory = false;
  std::string nvme_path;
  int64_t buffer_count = 4;
  bool fast_init = false;        ///< offload_optimizer only
  double ratio = 1.0;            ///< offload_optimizer only (< 1 needs stage 3)
  int64_t buffer_size = 100000000;   ///< offload_param only
  int64_t max_in_cpu = 1000000000;   ///< offload_param only
  bool pipeline_read = false;    ///< offload_optimizer only
  bool pipeline_write = false;   ///< offload_optimizer only
};
struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool overlap_comm = false;  ///< not given in JSON: true at stage 3 (DeepSpeed's dynamic default)
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  bool round_robin_gradients = false;
  bool elastic_checkpoint = false;
  ZeroOffloadConfig offload_optimizer;
  ZeroOffloadConfig offload_param = [] {  // DeepSpeed's param offload keeps 5 buffers, not 4
    ZeroOffloadConfig c;
    c.buffer_count = 5;
    return c;
  }();
  int64_t sub_group_size = 1000000000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool ignore_unused_parameters = true;
  bool legacy_stage1 = false;
};

/// `activation_checkpointing` block.
struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  std::optional<int64_t> number_checkpoints;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

/// DeepSpeed's `pipeline` block (PipelineModule's partition_method and
/// activation_checkpoint_interval, Megatron's virtual pipeline stages) with polytrain's schedule
/// choice. The pipeline size itself is trainer.pipeline_parallel_size (or `stages` here).
struct PipelineConfig {
  int64_t stages = 0;  ///< 0: "auto" (trainer.pipeline_parallel_size decides)
  /// How layers are dealt to stages: "parameters" (balanced parameter counts, DeepSpeed's
  /// default), "uniform" (balanced layer counts) or "type:REGEX" (balanced count of layers whose
  /// class name matches REGEX, case-insensitive).
  std::string partition = "parameters";
  int64_t activation_checkpoint_interval = 0;  ///< 0: off; k: every k layers of a stage recomputed in backward
  int64_t virtual_stages = 1;                  ///< model chunks per stage (> 1: interleaved 1F1B)
  std::string schedule = "1f1b";  ///< 1f1b (PipeDream-flush; interleaved when virtual_stages > 1), gpipe, zbh1 (zero bubble)
};

/// `tensorboard` / `csv_monitor` blocks.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
};

/// `data` section: what to read and how to mask it.
struct DataConfig {
  std::vector<std::string> train_files;  ///< text files; relative ones resolve as config_paths.h says
  std::string vocab_file;                ///< vocab.txt (one token per line)
  int64_t max_seq_length = 128;
  double eval_fraction = 0.05;           ///< share of blocks held out for evaluation
  double mask_prob = 0.15;
  double random_replace_prob = 0.1;      ///< of masked positions: replaced by a random token
  double unmask_replace_prob = 0.1;      ///< of masked positions: left unchanged
  bool whole_word_mask = false;
  int64_t eval_batches = 8;              ///< micro-batches per evaluation (0 = whole eval split)
};

/// FlagAI-style trainer options (`trainer` section; also settable from C++ and CLI flags).
struct TrainerOptions {
  std::string env_type = "pytorch";  ///< pytorch, pytorchDDP, deepspeed, deepspeed+mpu, hivemind
  int64_t epochs = 1;
  int64_t max_steps = 0;              ///< optimizer steps; 0 = run `epochs` epochs
  int64_t eval_interval = 100;
  int64_t log_interval = 10;
  int64_t save_interval = 0;          ///< 0 = only at the end
  std::string save_dir;               ///< "" = <experiment dir>/checkpoints
  std::string load_dir;               ///< resume from the latest checkpoint here
  std::string experiments_dir = "experiments";
  std::string experiment_name = "default";
  /// fp32 matrix products on CUDA in TF32 (torch.set_float32_matmul_precision("high")); off:
  /// full fp32 ("highest", PyTorch's default). No effect on the CPU.
  bool tf32 = false;
  std::string exp_type = "train";
  uint64_t seed = 1234;
  std::string pytorch_device = "cpu"; ///< cpu, cuda, cuda:N
  int64_t num_threads = 0;            ///< torch intra-op threads; 0 = OMP_NUM_THREADS, else CPUs / local processes
  bool checkpoint_activations = false;
  bool save_safetensors = false;      ///< also write model.safetensors next to checkpoints
  int64_t keep_last = 2;              ///< step checkpoints kept (best kept separately)
  bool progress_bar = true;
  // Data-parallel backends (pytorchDDP, later deepspeed):
  std::string comm_backend = "auto";  ///< gloo, mpi, nccl, auto (nccl on CUDA, mpi under mpirun or launch on one host, else gloo)
  double comm_timeout = 1800;         ///< seconds before a collective fails (naming rank and op) instead of hanging
  int64_t reduce_bucket_size = 25000000;  ///< bytes of gradients per all-reduce bucket
  bool overlap_comm = true;           ///< start each bucket's all-reduce while backward still runs
  bool find_unused_parameters = false;  ///< parameters without a gradient in a step are allowed (zeros averaged)
  /// Tensor-parallel size (FlagAI's name; Megatron's tensor_model_parallel_size is an alias):
  /// world = model_parallel_size x data-parallel size. Above 1 needs env_type deepspeed+mpu.
  int64_t model_parallel_size = 1;
  /// Pipeline stages (Megatron's pipeline_model_parallel_size): world = model_parallel_size x
  /// pipeline_parallel_size x data-parallel size. Above 1 needs pytorchDDP, deepspeed (ZeRO 0-2)
  /// or deepspeed+mpu.
  int64_t pipeline_parallel_size = 1;
  // FlagAI's self-launch (self_launch.h): a pytorchDDP / deepspeed / deepspeed+mpu program run
  // without a launcher re-executes itself under `launch` when any of the first three is given.
  int64_t num_gpus = 0;          ///< processes (GPUs) per host; 0 = launch's default
  int64_t num_nodes = 0;         ///< hosts of the hostfile to use; 0 = all
  std::string hostfile;          ///< DeepSpeed-style hostfile ("" = this machine)
  std::string master_ip;         ///< rendezvous address (launch's --master_addr; "" = the first host)
  int64_t master_port = 0;       ///< rendezvous port (0 = launch's default, 29500)
  std::string training_script;   ///< the program launch starts ("" = this one)
};

/// `hivemind` section: decentralized training (env_type hivemind), hivemind.Optimizer's and
/// the collaborative ALBERT recipe's names. Durations in seconds.
struct HivemindConfig {
  std::string run_id = "polytrain";       ///< the swarm: DHT network id and key prefix
  std::string listen = "0.0.0.0:0";       ///< HOST:PORT: DHT (UDP) and averaging (TCP) bind here
  std::string announce;                   ///< HOST:PORT others reach this peer at ("" = the bound address)
  std::vector<std::string> initial_peers;  ///< HOST:PORT of peers already in the swarm
  int64_t target_batch_size = 0;          ///< samples per global step over the swarm (required)
  /// This peer steps once the swarm has target_batch_size - batch_size_lead samples (hivemind's
  /// albert example: the target it hands the optimizer); 0 <= lead < target_batch_size.
  int64_t batch_size_lead = 0;
  double matchmaking_time = 15.0;         ///< alias averaging_expiration (hivemind's older name)
  double averaging_timeout = 60.0;        ///< matchmaking + all-reduce of one round
  double allreduce_timeout = 0.0;         ///< the all-reduce alone (0 = averaging_timeout)
  double next_chunk_timeout = 10.0;
  double request_timeout = 3.0;
  double bootstrap_timeout = 10.0;
  double load_state_timeout = 600.0;      ///< a whole state download (one deadline)
  double metadata_expiration = 60.0;      ///< progress records' lifetime (>= 11)
  int64_t min_group_size = 2;
  int64_t target_group_size = 256;
  bool client_mode = false;               ///< no inbound connections: joins groups, reduces nothing
  /// An auxiliary peer (RuLeanALBERT's --assist_in_averaging, hivemind's auxiliary=True): trains
  /// nothing; joins every round to reduce a share of it by its bandwidth, with weight 0.
  bool assist_in_averaging = false;
  double bandwidth = 1.0;                 ///< relative share of each average this peer reduces
  std::string compression = "none";       ///< none, fp16, scaled_fp16, uint8, int4
  /// How a reducer combines its part: "mean" (weighted by samples) or "centered_clip"
  /// (CenteredClip, robust to a minority of poisoned contributions; src/swarm/robust.h).
  std::string aggregation = "mean";
  double centered_clip_tau = 1.0;         ///< CenteredClip's clipping radius (L2, per part)
  int64_t centered_clip_iterations = 5;   ///< at most this many CenteredClip iterations
  int64_t average_state_every = 1;        ///< also average parameters every k global steps (0 = never)
  /// Optimizer statistics averaged with the parameters (hivemind's average_opt_statistics), e.g.
  /// ["exp_avg", "exp_avg_sq"]; optimizer_statistics() lists those of each optimizer.
  std::vector<std::string> average_opt_statistics;
  bool offload_optimizer = false;         ///< keep the averaged gradients and the update on a CPU copy
  bool delay_optimizer_step = false;      ///< run the update in the background (one step stale)
  std::string identity_path;              ///< Ed25519 key file ("" = a new identity per start)
  /// Trainer peers to wait for before the first step (0 = none): with every peer present from
  /// the start, each global batch is split the same way every time (reproducible runs, tests).
  int64_t expected_peers = 0;
  /// Data stream of this peer: stream `stream_index` of `num_streams` disjoint streams of each
  /// epoch's order (num_streams 0 = a stream drawn from the peer's identity, like hivemind's
  /// per-peer shuffling).
  int64_t num_streams = 0;
  int64_t stream_index = 0;
};

/// The whole resolved config.
struct Config {
  BatchConfig batch;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  AmpConfig amp;
  double gradient_clipping = 0.0;  ///< 0 = off
  /// DeepSpeed's print interval: when given and trainer.log_interval is not, it sets log_interval.
  int64_t steps_per_print = 10;
  /// DeepSpeed's timer report: the log line also shows forward / backward / step milliseconds.
  bool wall_clock_breakdown = false;
  ZeroConfig zero_optimization;
  ActivationCheckpointingConfig activation_checkpointing;
  bool activation_checkpointing_present = false;  ///< the block was given
  PipelineConfig pipeline;
  bool pipeline_present = false;  ///< the block was given
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;
  ModelConfig model;
  DataConfig data;
  TrainerOptions trainer;
  HivemindConfig hivemind;
  /// DeepSpeed keys accepted but not implemented (warned about once), in JSON path form.
  std::vector<std::string> ignored_keys;
  /// The JSON as the user gave it (before defaults), for the record.
  nlohmann::json source = nlohmann::json::object();
};

/// Parses JSON text strictly: duplicate keys are InputError naming the path and line.
/// `origin` names the file in messages.
nlohmann::json parse_json_strict(const std::string& text, const std::string& origin);

/// Builds a Config from a parsed JSON document. Unknown keys are InputError naming the JSON
/// path and suggesting the nearest known key; inconsistent values are InputError naming the key.
/// The batch triple is resolved at the data-parallel size: `world_size` (< 1: read WORLD_SIZE
/// from the environment, 1 when unset) divided by trainer.model_parallel_size.
Config config_from_json(const nlohmann::json& doc, const std::string& origin, int64_t world_size = 0);

/// Reads and parses a config file (InputError when it is missing or malformed). Its relative
/// input paths resolve against its folder (config_paths.h); whether those files exist is not
/// checked here (a run's build_config checks it).
Config load_config(const std::string& path, int64_t world_size = 0);

/// Re-resolves the batch triple after a CLI override or at a new world size (divided by
/// cfg.trainer.model_parallel_size, as config_from_json does).
void resolve_batch(Config& cfg, const nlohmann::json& batch_source, int64_t world_size);

/// Why a swarm peer cannot run with `cfg`'s hivemind.target_batch_size (unset, or smaller than
/// its micro-batch), or "": the one home of that rule (the parser and the hivemind backend).
std::string swarm_batch_error(const Config& cfg);

/// The resolved config as JSON (every key, defaults filled in); load_config of its dump gives
/// back an equal Config.
nlohmann::json config_to_json(const Config& cfg);

/// Writes one `warning: ...` line on stderr naming cfg.ignored_keys, if any.
void warn_ignored_keys(const Config& cfg);

}  // namespace polytrain
