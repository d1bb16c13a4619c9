// Command-line side of the config: --config FILE, --print_config, one flag per trainer option and
// a few DeepSpeed/data overrides. Each given flag is written into a JSON patch at its config path,
// so the file's checks apply to it; build_config merges file and patch and parses the result.
// The parsing and validation themselves are config.cpp's.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace CLI {
class App;
}  // namespace CLI

namespace polytrain {

/// What add_config_flags fills in while CLI11 parses.
struct ConfigFlags {
  std::string config_path;    ///< --config FILE; "" = no file (the config is {} plus overrides)
  bool print_config = false;  ///< --print_config: the program prints config_to_json and exits
  /// --local_rank=N as launchers append it (torch.distributed.launch / DeepSpeed style); the
  /// rank itself is read from the environment (common/dist_env.h).
  int local_rank = -1;
  /// The given flags at their JSON paths, e.g. {"trainer": {"epochs": 3}} for --epochs 3.
  nlohmann::json overrides = nlohmann::json::object();
};

/// Registers --config, --print_config and one flag per option a user sets most, in --help
/// groups (Trainer, Batch, Optimizer, Precision, Parallel, Data, Hivemind, Launcher side) with
/// the config structs' defaults shown: the trainer options, the batch triple and FlagAI's
/// --batch_size (train_micro_batch_size_per_gpu), --lr, --weight_decay, --clip_grad
/// (gradient_clipping), --warm_up (trainer.warm_up), --fp16/--bf16/--tf32, --env_type,
/// --model_parallel_size, --zero_stage, --offload_optimizer, --train_files, --vocab_file, the
/// hivemind section's keys and FlagAI's self-launch names (--num_gpus, --num_nodes, --hostfile,
/// --master_ip/--master_addr, --master_port, --training_script). `flags` must outlive the parse.
void add_config_flags(CLI::App& app, ConfigFlags& flags);

/// Parses argv with app. Returns false when --help (or --version) was asked for: the text is on
/// stdout and the caller should exit 0. Any other CLI11 error becomes one-line InputError (exit 2);
/// an unknown flag names the nearest known one ("unknown flag --max_step; did you mean --max_steps?").
bool parse_cli(CLI::App& app, int argc, char** argv);

/// The file's JSON with the overrides merged in (RFC 7386 merge patch), plus the batch rule:
/// when the overrides give any of the three batch keys, the file's batch keys they do not give
/// are kept if the triple stays consistent at world_size; otherwise the largest consistent
/// subset is kept, preferring all of them, then train_batch_size alone, then
/// train_micro_batch_size_per_gpu, then gradient_accumulation_steps; failing that, only the
/// overrides' batch keys remain (and their own error, if any, is reported by config_from_json).
/// Example at world size 1: file {32, 8, 4} + --train_micro_batch_size_per_gpu 16 -> {32, 16, 2}.
nlohmann::json apply_overrides(const nlohmann::json& file_doc, const nlohmann::json& overrides,
                               int64_t world_size = 0);

/// Loads flags.config_path (or starts from {}), applies flags.overrides (apply_overrides), and
/// parses the result with config_from_json at world_size (< 1: WORLD_SIZE, else 1). With
/// world_size < 1, a run that starts itself under `launch` (self_launch.h: the trainer keys
/// env_type, num_gpus, num_nodes, hostfile) re-executes here, before the config is checked.
Config build_config(const ConfigFlags& flags, int64_t world_size = 0);

}  // namespace polytrain
