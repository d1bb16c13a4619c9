// CLI11 flags that write into the config's JSON patch, the merge of file and patch (with the
// batch-key rule documented in cli_config.h), and CLI11 errors turned into InputError.
// Validation of the values is left to config_from_json, so a flag is checked like the file is.
#include "polytrain/common/cli_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "polytrain/common/cli_suggest.h"
#include "polytrain/common/config_paths.h"
#include "polytrain/common/error.h"
#include "polytrain/common/fault_tolerance_config.h"
#include "polytrain/common/self_launch.h"

namespace polytrain {

using nlohmann::json;

namespace {

const char* const kBatchKeys[] = {"train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps"};

void put(json& root, const std::vector<std::string>& path, json value) {
  json* node = &root;
  for (size_t i = 0; i + 1 < path.size(); ++i) node = &(*node)[path[i]];
  (*node)[path.back()] = std::move(value);
}

// Group headings of --help, in the order they are listed (after CLI11's "Options": --help,
// --config and each program's own flags).
const char* const kTrainerGroup = "Trainer";
const char* const kBatchGroup = "Batch (DeepSpeed's triple; 0 = derived from the other two)";
const char* const kOptimizerGroup = "Optimizer";
const char* const kPrecisionGroup = "Precision";
const char* const kParallelGroup = "Parallel";
const char* const kDataGroup = "Data";
const char* const kHivemindGroup = "Hivemind (env_type hivemind; docs/hivemind.md)";
const char* const kLauncherGroup = "Launcher side (a run that starts itself under launch; docs/launcher.md)";

// A config struct's default as --help shows it ("" shows none).
template <typename T>
std::string shown(const T& v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

template <typename T>
CLI::Option* add_value(CLI::App& app, ConfigFlags& flags, const std::string& name, std::vector<std::string> path,
                       const std::string& help) {
  return app.add_option_function<T>(
      name, [&flags, path](const T& v) { put(flags.overrides, path, json(v)); }, help);
}

CLI::Option* add_switch(CLI::App& app, ConfigFlags& flags, const std::string& name, std::vector<std::string> path,
                        bool value, const std::string& help) {
  return app.add_flag_function(
      name, [&flags, path, value](std::int64_t) { put(flags.overrides, path, json(value)); }, help);
}

std::vector<std::string> trainer_key(const char* key) { return {"trainer", key}; }
std::vector<std::string> hivemind_key(const char* key) { return {"hivemind", key}; }

bool batch_consistent(const json& doc, int64_t world_size) {
  try {
    Config probe;
    resolve_batch(probe, doc, world_size);
    return true;
  } catch (const InputError&) {
    return false;
  }
}

}  // namespace

namespace {

void add_trainer_flags(CLI::App& app, ConfigFlags& flags) {
  const TrainerOptions d;
  auto value = [&](const char* key, const std::string& help, const std::string& def) {
    return add_value<int64_t>(app, flags, std::string("--") + key, trainer_key(key), help)->default_str(def)->group(kTrainerGroup);
  };
  auto text = [&](const char* key, const std::string& help, const std::string& def) {
    return add_value<std::string>(app, flags, std::string("--") + key, trainer_key(key), help)->default_str(def)->group(kTrainerGroup);
  };
  value("epochs", "epochs to train", shown(d.epochs));
  value("max_steps", "optimizer steps (0 = run --epochs epochs)", shown(d.max_steps));
  value("eval_interval", "steps between evaluations", shown(d.eval_interval));
  value("log_interval", "steps between log lines", shown(d.log_interval));
  value("save_interval", "steps between checkpoints (0 = only at the end)", shown(d.save_interval));
  text("save_dir", "checkpoint folder (default: <experiment folder>/checkpoints)", d.save_dir);
  text("load_dir", "resume from the latest checkpoint in this folder", d.load_dir);
  text("experiments_dir", "folder that holds the experiment folders", d.experiments_dir);
  text("experiment_name", "experiment name (its folder's name starts with it)", d.experiment_name);
  add_value<uint64_t>(app, flags, "--seed", trainer_key("seed"), "random seed")->default_str(shown(d.seed))->group(kTrainerGroup);
  text("pytorch_device", "cpu, cuda or cuda:N", d.pytorch_device);
  value("num_threads", "torch intra-op threads (0 = OMP_NUM_THREADS, else this machine's CPUs / local processes)",
        shown(d.num_threads));
  add_switch(app, flags, "--checkpoint_activations", trainer_key("checkpoint_activations"), true,
             "recompute activations in backward (less memory, more compute)")->group(kTrainerGroup);
  add_switch(app, flags, "--save_safetensors", trainer_key("save_safetensors"), true,
             "also write model.safetensors with each checkpoint")->group(kTrainerGroup);
  add_switch(app, flags, "--no_progress_bar", trainer_key("progress_bar"), false, "no progress bar")->group(kTrainerGroup);
}

// DeepSpeed's three names and FlagAI's --batch_size; each is a batch key of apply_overrides' rule.
void add_batch_flags(CLI::App& app, ConfigFlags& flags) {
  auto* micro = add_value<int64_t>(app, flags, "--train_micro_batch_size_per_gpu", {"train_micro_batch_size_per_gpu"},
                                   "samples per forward/backward on each data-parallel rank");
  add_value<int64_t>(app, flags, "--train_batch_size", {"train_batch_size"},
                     "samples per optimizer step over all data-parallel ranks")->group(kBatchGroup);
  micro->group(kBatchGroup);
  add_value<int64_t>(app, flags, "--gradient_accumulation_steps", {"gradient_accumulation_steps"},
                     "micro-batches accumulated per optimizer step")->group(kBatchGroup);
  // One setting under two names: the later would silently win, so giving both is refused.
  app.add_option_function<int64_t>(
         "--batch_size",
         [&flags, micro](const int64_t& v) {
           if (micro->count() > 0)
             throw InputError("--batch_size and --train_micro_batch_size_per_gpu are one setting (FlagAI's and "
                              "DeepSpeed's name for it): give one");
           put(flags.overrides, {"train_micro_batch_size_per_gpu"}, json(v));
         },
         "FlagAI's name of --train_micro_batch_size_per_gpu")
      ->group(kBatchGroup);
}

void add_optimizer_flags(CLI::App& app, ConfigFlags& flags) {
  const OptimizerConfig o;
  add_value<double>(app, flags, "--lr", {"optimizer", "params", "lr"}, "learning rate (optimizer.params.lr)")
      ->default_str(shown(o.lr))->group(kOptimizerGroup);
  add_value<double>(app, flags, "--weight_decay", {"optimizer", "params", "weight_decay"},
                    "weight decay (optimizer.params.weight_decay)")->default_str(shown(o.weight_decay))->group(kOptimizerGroup);
  add_value<double>(app, flags, "--clip_grad,--gradient_clipping", {"gradient_clipping"},
                    "clip gradients to this global norm (DeepSpeed's gradient_clipping; 0 = off)")
      ->default_str("0")->group(kOptimizerGroup);
  add_value<double>(app, flags, "--warm_up", trainer_key("warm_up"),
                    "FlagAI's warm-up: share of the run's steps spent warming the learning rate up (trainer.warm_up)")
      ->group(kOptimizerGroup);
}

void add_precision_flags(CLI::App& app, ConfigFlags& flags) {
  add_switch(app, flags, "--fp16", {"fp16", "enabled"}, true, "fp16 mixed precision with dynamic loss scaling (fp16.enabled)")
      ->group(kPrecisionGroup);
  add_switch(app, flags, "--bf16", {"bf16", "enabled"}, true, "bf16 mixed precision (bf16.enabled)")->group(kPrecisionGroup);
  add_switch(app, flags, "--tf32", trainer_key("tf32"), true, "fp32 matrix products in TF32 on CUDA (trainer.tf32)")
      ->group(kPrecisionGroup);
}

void add_parallel_flags(CLI::App& app, ConfigFlags& flags) {
  const TrainerOptions d;
  add_value<std::string>(app, flags, "--env_type", trainer_key("env_type"),
                         "pytorch (one process), pytorchDDP, deepspeed (ZeRO), deepspeed+mpu (tensor x data "
                         "parallel) or hivemind (a swarm)")->default_str(d.env_type)->group(kParallelGroup);
  add_value<int64_t>(app, flags, "--model_parallel_size", trainer_key("model_parallel_size"),
                     "tensor-parallel size (world = model_parallel_size x data-parallel size)")
      ->default_str(shown(d.model_parallel_size))->group(kParallelGroup);
  add_value<int64_t>(app, flags, "--pipeline_parallel_size", trainer_key("pipeline_parallel_size"),
                     "pipeline stages (world = model_parallel_size x pipeline_parallel_size x data-parallel size)")
      ->default_str(shown(d.pipeline_parallel_size))->group(kParallelGroup);
  add_value<std::string>(app, flags, "--pipeline_schedule", {"pipeline", "schedule"},
                         "1f1b (interleaved with --virtual_stages > 1), gpipe or zbh1 (zero bubble; pipeline.schedule)")
      ->default_str("1f1b")->group(kParallelGroup);
  add_value<int64_t>(app, flags, "--virtual_stages", {"pipeline", "virtual_stages"},
                     "model chunks per pipeline stage: above 1, Megatron's interleaved 1F1B (pipeline.virtual_stages)")
      ->default_str("1")->group(kParallelGroup);
  add_value<int64_t>(app, flags, "--zero_stage", {"zero_optimization", "stage"},
                     "ZeRO stage 0, 1, 2 or 3 for env_type deepspeed and deepspeed+mpu (zero_optimization.stage)")
      ->default_str("0")->group(kParallelGroup);
  add_value<std::string>(app, flags, "--offload_optimizer", {"zero_optimization", "offload_optimizer", "device"},
                         "cpu or none: ZeRO-Offload (zero_optimization.offload_optimizer.device)")
      ->default_str("none")->group(kParallelGroup);
  add_value<std::string>(app, flags, "--offload_param", {"zero_optimization", "offload_param", "device"},
                         "cpu or none: stage 3's parameter partitions in CPU memory (zero_optimization.offload_param.device)")
      ->default_str("none")->group(kParallelGroup);
  add_switch(app, flags, "--fault_tolerance", {"trainer", "fault_tolerance", "enabled"}, true,
             "pytorchDDP over Gloo survives lost ranks: the others regroup and redo the step over the same global "
             "batch (trainer.fault_tolerance; docs/fault_tolerance.md)")->group(kParallelGroup);
  add_value<int64_t>(app, flags, "--min_world_size", {"trainer", "fault_tolerance", "min_world_size"},
                     "fewest ranks a fault-tolerant job goes on with; implies --fault_tolerance "
                     "(trainer.fault_tolerance.min_world_size)")
      ->default_str("1")->group(kParallelGroup);
}

void add_data_flags(CLI::App& app, ConfigFlags& flags) {
  add_value<std::vector<std::string>>(app, flags, "--train_files", {"data", "train_files"},
                                      "plain-text training files (data.train_files)")->group(kDataGroup);
  add_value<std::string>(app, flags, "--vocab_file", {"data", "vocab_file"},
                         "the tokenizer's vocabulary (data.vocab_file): BERT's vocab.txt for train_bert and "
                         "train_albert, GPT-2's encoder.json for train_gpt2 (vocab.bpe beside it, or --merges), "
                         "a SentencePiece .model for train_t5")->group(kDataGroup);
}

// What each key does, in hivemind's words (docs/hivemind.md's table).
void add_hivemind_values(CLI::App& app, ConfigFlags& flags) {
  const HivemindConfig d;
  // One flag per key, of the key's type, with its default shown.
  auto flag = [&](const char* key, const std::string& help, const auto& def) {
    using T = std::decay_t<decltype(def)>;
    return add_value<T>(app, flags, std::string("--") + key, hivemind_key(key), help)
        ->default_str(shown(def))
        ->group(kHivemindGroup);
  };
  flag("run_id", "the swarm's name: peers with the same run_id train together (DHT network id and key prefix)", d.run_id);
  flag("listen", "HOST:PORT this peer's DHT (UDP) and averaging (TCP) sockets bind (port 0: any free port)", d.listen);
  flag("announce", "HOST:PORT other peers reach this one at (default: the bound address)", d.announce);
  flag("compression", "how averaged tensors travel: none, fp16, scaled_fp16, uint8 or int4", d.compression);
  flag("identity_path", "Ed25519 key file of this peer, created when missing (default: a new identity each start)",
       d.identity_path);
  flag("target_batch_size", "samples the whole swarm accumulates per global step (required for hivemind)",
       d.target_batch_size)
      ->default_str("");  // 0 is "not set", which a swarm refuses
  flag("batch_size_lead", "look for an averaging group this many samples before target_batch_size", d.batch_size_lead);
  flag("min_group_size", "fewest peers an averaging group starts with when its time is up", d.min_group_size);
  flag("target_group_size", "most peers in one averaging group (a full group starts at once)", d.target_group_size);
  flag("average_state_every", "also average the parameters every k global steps (0 = never)", d.average_state_every);
  flag("expected_peers", "trainer peers to wait for before the first step, for reproducible runs (0 = none)",
       d.expected_peers);
  flag("num_streams", "split each epoch's samples into this many disjoint streams (0 = each peer shuffles on its own)",
       d.num_streams);
  flag("stream_index", "which of --num_streams streams this peer reads", d.stream_index);
  flag("averaging_timeout", "seconds one global step's averaging (matchmaking + all-reduce) may take",
       d.averaging_timeout);
  flag("allreduce_timeout", "seconds the all-reduce alone may take (0 = --averaging_timeout)", d.allreduce_timeout);
  flag("next_chunk_timeout", "seconds to wait for first contact and each next chunk of a stream", d.next_chunk_timeout);
  flag("request_timeout", "seconds to wait for the answer to a join request", d.request_timeout);
  flag("bootstrap_timeout", "seconds to join the swarm through --initial_peers", d.bootstrap_timeout);
  flag("metadata_expiration", "seconds a peer's progress record lives in the DHT (>= 11)", d.metadata_expiration);
  flag("load_state_timeout", "seconds a whole state download from other peers may take", d.load_state_timeout);
  flag("bandwidth", "relative share of each average this peer reduces (at most 1e6)", d.bandwidth);
  flag("aggregation", "how a reducer combines its part of the gradients: mean or centered_clip", d.aggregation);
  flag("centered_clip_tau", "centered_clip's radius (L2 over a whole part)", d.centered_clip_tau);
  flag("centered_clip_iterations", "centered_clip's iterations from the coordinate-wise median",
       d.centered_clip_iterations);
}

// --averaging_expiration is hivemind's CollaborativeOptimizer name of matchmaking_time (its JSON
// alias): either flag writes its own key (so that errors name the flag given) and removes the
// other name from the file's section (a merge patch's null), as any flag replaces the file.
void add_matchmaking_time(CLI::App& app, ConfigFlags& flags) {
  const HivemindConfig d;
  auto same_setting = [&](const char* key, const char* other, const std::string& help) {
    return app
        .add_option_function<double>(
            std::string("--") + key,
            [&flags, key, other](const double& v) {
              put(flags.overrides, hivemind_key(key), json(v));
              put(flags.overrides, hivemind_key(other), json(nullptr));
            },
            help)
        ->default_str(shown(d.matchmaking_time))
        ->group(kHivemindGroup);
  };
  same_setting("averaging_expiration", "matchmaking_time", "--matchmaking_time under hivemind's CollaborativeOptimizer name")
      ->excludes(same_setting("matchmaking_time", "averaging_expiration",
                              "seconds a peer that declared itself leader waits for others to join its group"));
}

void add_hivemind_lists_and_switches(CLI::App& app, ConfigFlags& flags) {
  auto list = [&](const char* key, const std::string& help) {
    app.add_option_function<std::vector<std::string>>(
           std::string("--") + key, [&flags, key](const std::vector<std::string>& v) { put(flags.overrides, hivemind_key(key), json(v)); },
           help)
        ->delimiter(',')
        ->group(kHivemindGroup);
  };
  list("initial_peers", "HOST:PORT[,HOST:PORT...] of peers already in the swarm, to join through (none: start a swarm)");
  list("average_opt_statistics", "NAME[,NAME...] optimizer statistics averaged with the parameters, e.g. exp_avg,exp_avg_sq");
  add_switch(app, flags, "--client_mode", hivemind_key("client_mode"), true,
             "accept no inbound connections (behind a firewall or NAT): join groups, reduce nothing")->group(kHivemindGroup);
  add_switch(app, flags, "--assist_in_averaging", hivemind_key("assist_in_averaging"), true,
             "an auxiliary peer: trains nothing, reduces a share of every averaging round by its --bandwidth (with "
             "weight 0), so client-mode peers can average through it")->group(kHivemindGroup);
  add_switch(app, flags, "--delay_optimizer_step", hivemind_key("delay_optimizer_step"), true,
             "run each update in the background, one step stale (needs the config key hivemind.offload_optimizer; "
             "--offload_optimizer is ZeRO's)")->group(kHivemindGroup);
}

// FlagAI's self-launch: without a launcher around it, a data-parallel program given these
// starts itself under `launch` (self_launch.h).
void add_launcher_flags(CLI::App& app, ConfigFlags& flags) {
  app.add_option("--local_rank", flags.local_rank, "set by launchers; the rank comes from the environment")
      ->group(kLauncherGroup);
  add_value<int64_t>(app, flags, "--num_gpus", trainer_key("num_gpus"),
                     "processes (GPUs) per host: above 1, a pytorchDDP/deepspeed run starts itself under launch")
      ->group(kLauncherGroup);
  add_value<int64_t>(app, flags, "--num_nodes", trainer_key("num_nodes"), "use the first N hosts of the hostfile (0 = all)")
      ->group(kLauncherGroup);
  add_value<std::string>(app, flags, "--hostfile", trainer_key("hostfile"), "DeepSpeed-style hostfile ('HOST slots=N' lines)")
      ->group(kLauncherGroup);
  add_value<std::string>(app, flags, "--master_ip,--master_addr", trainer_key("master_ip"),
                         "rendezvous address (default: the first host)")->group(kLauncherGroup);
  add_value<int64_t>(app, flags, "--master_port", trainer_key("master_port"), "rendezvous port")
      ->default_str("29500")->group(kLauncherGroup);
  add_value<std::string>(app, flags, "--training_script", trainer_key("training_script"),
                         "the program launch starts (default: this one)")->group(kLauncherGroup);
}

}  // namespace

void add_config_flags(CLI::App& app, ConfigFlags& flags) {
  app.get_formatter()->column_width(40);
  app.add_option("--config", flags.config_path,
                 "JSON config: a DeepSpeed config plus optional model/data/trainer sections");
  app.add_flag("--print_config", flags.print_config, "print the resolved config as JSON and exit");
  add_trainer_flags(app, flags);
  add_batch_flags(app, flags);
  add_optimizer_flags(app, flags);
  add_precision_flags(app, flags);
  add_parallel_flags(app, flags);
  add_data_flags(app, flags);
  add_hivemind_values(app, flags);
  add_matchmaking_time(app, flags);
  add_hivemind_lists_and_switches(app, flags);
  add_launcher_flags(app, flags);
}

bool parse_cli(CLI::App& app, int argc, char** argv) {
  app.allow_extras();  // reported below as one line that names the nearest flag
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --help-all, --version
    app.exit(e);
    std::cout.flush();
    return false;
  } catch (const CLI::ParseError& e) {
    throw InputError(std::string("command line: ") + e.what() + " (see --help)");
  }
  if (!app.remaining().empty()) throw InputError(cli::unknown_argument_message(app, app.remaining()));
  return true;
}

json apply_overrides(const json& file_doc, const json& overrides, int64_t world_size) {
  json merged = file_doc.is_null() ? json::object() : file_doc;
  if (!merged.is_object()) return merged;  // config_from_json reports it
  merged.merge_patch(overrides);
  std::vector<std::string> file_only;  // batch keys the file gives and the overrides do not
  bool cli_batch = false;
  for (const char* key : kBatchKeys) {
    const bool in_cli = overrides.is_object() && overrides.contains(key);
    cli_batch = cli_batch || in_cli;
    if (!in_cli && file_doc.contains(key) && !file_doc[key].is_null()) file_only.push_back(key);
  }
  if (!cli_batch || file_only.empty()) return merged;
  std::vector<std::vector<std::string>> keep = {file_only};
  if (file_only.size() > 1)
    for (const auto& key : file_only) keep.push_back({key});
  keep.push_back({});
  for (const auto& kept : keep) {
    json candidate = merged;
    for (const auto& key : file_only)
      if (std::find(kept.begin(), kept.end(), key) == kept.end()) candidate.erase(key);
    if (batch_consistent(candidate, world_size) || kept.empty()) return candidate;
  }
  return merged;  // not reached: the empty subset is always returned
}

Config build_config(const ConfigFlags& flags, int64_t world_size) {
  json doc = json::object();
  std::string origin = "command line";
  if (!flags.config_path.empty()) {
    const std::string& path = flags.config_path;
    if (std::filesystem::is_directory(path)) throw InputError(path + ": is a directory, not a config file");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InputError(path + ": cannot read config file");
    std::ostringstream text;
    text << in.rdbuf();
    doc = parse_json_strict(text.str(), path);
    origin = flags.overrides.empty() ? path : path + " + command line";
  }
  // The file's input paths resolve against its folder, FlagAI's names become DeepSpeed's keys;
  // unreadable input files are reported with the config's other errors.
  std::vector<std::string> path_errors = prepare_config_sources(doc, flags.config_path, flags.overrides);
  json merged = apply_overrides(doc, flags.overrides, world_size);
  // A data-parallel run that starts itself under `launch` does it before its config is
  // resolved: the batch triple is checked in the ranks, at the world launch gives them.
  if (world_size < 1) self_launch_if_asked(self_launch_options(merged));
  Config cfg = config_from_json_with(merged, origin, world_size, std::move(path_errors));
  resolve_fault_tolerance(cfg, origin);
  return cfg;
}

}  // namespace polytrain
