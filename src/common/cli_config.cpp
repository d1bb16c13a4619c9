// CLI11 flags that write into the config's JSON patch, the merge of file and patch (with the
// batch-key rule documented in cli_config.h), and CLI11 errors turned into InputError.
// Validation of the values is left to config_from_json, so a flag is checked like the file is.
#include "polytrain/common/cli_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>

#include "polytrain/common/error.h"
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

template <typename T>
void add_value(CLI::App& app, ConfigFlags& flags, const std::string& name,
               std::vector<std::string> path, const std::string& help) {
  app.add_option_function<T>(
      name, [&flags, path](const T& v) { put(flags.overrides, path, json(v)); }, help);
}

void add_switch(CLI::App& app, ConfigFlags& flags, const std::string& name,
                std::vector<std::string> path, bool value, const std::string& help) {
  app.add_flag_function(
      name, [&flags, path, value](std::int64_t) { put(flags.overrides, path, json(value)); }, help);
}

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

void add_config_flags(CLI::App& app, ConfigFlags& flags) {
  app.add_option("--config", flags.config_path,
                 "JSON config: a DeepSpeed config plus optional model/data/trainer sections");
  app.add_flag("--print_config", flags.print_config, "print the resolved config as JSON and exit");
  app.add_option("--local_rank", flags.local_rank, "set by launchers; the rank comes from the environment");
  auto trainer = [](const char* key) { return std::vector<std::string>{"trainer", key}; };
  add_value<std::string>(app, flags, "--env_type", trainer("env_type"),
                         "pytorch, pytorchDDP, deepspeed, deepspeed+mpu or hivemind");
  add_value<int64_t>(app, flags, "--epochs", trainer("epochs"), "epochs to train");
  add_value<int64_t>(app, flags, "--max_steps", trainer("max_steps"), "optimizer steps (0 = use epochs)");
  add_value<int64_t>(app, flags, "--eval_interval", trainer("eval_interval"), "steps between evaluations");
  add_value<int64_t>(app, flags, "--log_interval", trainer("log_interval"), "steps between log lines");
  add_value<int64_t>(app, flags, "--save_interval", trainer("save_interval"),
                     "steps between checkpoints (0 = only at the end)");
  add_value<std::string>(app, flags, "--save_dir", trainer("save_dir"), "checkpoint folder");
  add_value<std::string>(app, flags, "--load_dir", trainer("load_dir"), "resume from the latest checkpoint here");
  add_value<std::string>(app, flags, "--experiments_dir", trainer("experiments_dir"), "experiments root");
  add_value<std::string>(app, flags, "--experiment_name", trainer("experiment_name"), "experiment name");
  add_value<uint64_t>(app, flags, "--seed", trainer("seed"), "random seed");
  add_value<std::string>(app, flags, "--pytorch_device", trainer("pytorch_device"), "cpu, cuda or cuda:N");
  add_value<int64_t>(app, flags, "--num_threads", trainer("num_threads"),
                     "torch intra-op threads (0 = OMP_NUM_THREADS, else this machine's CPUs / local processes)");
  add_switch(app, flags, "--checkpoint_activations", trainer("checkpoint_activations"), true,
             "recompute activations in backward");
  add_switch(app, flags, "--save_safetensors", trainer("save_safetensors"), true,
             "also write model.safetensors with checkpoints");
  add_switch(app, flags, "--tf32", trainer("tf32"), true, "fp32 matrix products in TF32 on CUDA (trainer.tf32)");
  add_switch(app, flags, "--no_progress_bar", trainer("progress_bar"), false, "no progress bar");
  add_value<int64_t>(app, flags, "--model_parallel_size", trainer("model_parallel_size"),
                     "tensor-parallel size (world = model_parallel_size x data-parallel size)");
  // FlagAI's self-launch: without a launcher around it, a data-parallel program given these
  // starts itself under `launch` (self_launch.h).
  add_value<int64_t>(app, flags, "--num_gpus", trainer("num_gpus"),
                     "processes (GPUs) per host: above 1, a pytorchDDP/deepspeed run starts itself under launch");
  add_value<int64_t>(app, flags, "--num_nodes", trainer("num_nodes"), "hosts of the hostfile to use (self-launch)");
  add_value<std::string>(app, flags, "--hostfile", trainer("hostfile"), "DeepSpeed-style hostfile (self-launch)");
  add_value<std::string>(app, flags, "--master_ip,--master_addr", trainer("master_ip"), "rendezvous address (self-launch)");
  add_value<int64_t>(app, flags, "--master_port", trainer("master_port"), "rendezvous port (self-launch)");
  add_value<std::string>(app, flags, "--training_script", trainer("training_script"),
                         "the program launch starts (default: this one; self-launch)");
  add_value<int64_t>(app, flags, "--zero_stage", {"zero_optimization", "stage"},
                     "ZeRO stage 0, 1 or 2 for env_type deepspeed (zero_optimization.stage)");
  add_value<std::string>(app, flags, "--offload_optimizer", {"zero_optimization", "offload_optimizer", "device"},
                         "cpu or none: ZeRO-Offload (zero_optimization.offload_optimizer.device)");
  for (const char* key : kBatchKeys)
    add_value<int64_t>(app, flags, std::string("--") + key, {key}, std::string("DeepSpeed's ") + key);
  add_value<double>(app, flags, "--lr", {"optimizer", "params", "lr"}, "learning rate (optimizer.params.lr)");
  add_value<std::vector<std::string>>(app, flags, "--train_files", {"data", "train_files"},
                                      "training text files");
  add_value<std::string>(app, flags, "--vocab_file", {"data", "vocab_file"}, "vocab.txt");
  // Decentralized training (env_type hivemind): the hivemind section's keys.
  auto hm = [](const char* key) { return std::vector<std::string>{"hivemind", key}; };
  for (const char* key : {"run_id", "listen", "announce", "compression", "identity_path"})
    add_value<std::string>(app, flags, std::string("--") + key, hm(key), std::string("hivemind.") + key);
  for (const char* key : {"target_batch_size", "batch_size_lead", "min_group_size", "target_group_size",
                          "average_state_every", "expected_peers", "num_streams", "stream_index"})
    add_value<int64_t>(app, flags, std::string("--") + key, hm(key), std::string("hivemind.") + key);
  // --averaging_expiration is hivemind's CollaborativeOptimizer name of matchmaking_time (its
  // JSON alias): either flag writes its own key (so that errors name the flag given) and removes
  // the other name from the file's section (a merge patch's null), as any flag replaces the file.
  auto same_setting = [&](const char* key, const char* other, const std::string& help) {
    return app.add_option_function<double>(
        std::string("--") + key,
        [&flags, hm, key, other](const double& v) {
          put(flags.overrides, hm(key), json(v));
          put(flags.overrides, hm(other), json(nullptr));
        },
        help);
  };
  same_setting("averaging_expiration", "matchmaking_time",
               "hivemind.matchmaking_time under hivemind's CollaborativeOptimizer name")
      ->excludes(same_setting("matchmaking_time", "averaging_expiration",
                              "hivemind.matchmaking_time: seconds a declared peer waits for followers "
                              "(alias --averaging_expiration)"));
  for (const char* key : {"averaging_timeout", "allreduce_timeout", "next_chunk_timeout",
                          "request_timeout", "bootstrap_timeout", "metadata_expiration", "load_state_timeout",
                          "bandwidth"})
    add_value<double>(app, flags, std::string("--") + key, hm(key), std::string("hivemind.") + key);
  app.add_option_function<std::vector<std::string>>(
         "--initial_peers", [&flags](const std::vector<std::string>& v) { put(flags.overrides, {"hivemind", "initial_peers"}, json(v)); },
         "HOST:PORT[,HOST:PORT...] of peers already in the swarm (hivemind.initial_peers)")
      ->delimiter(',');
  app.add_option_function<std::vector<std::string>>(
         "--average_opt_statistics",
         [&flags](const std::vector<std::string>& v) { put(flags.overrides, {"hivemind", "average_opt_statistics"}, json(v)); },
         "NAME[,NAME...] optimizer statistics averaged with the parameters, e.g. exp_avg,exp_avg_sq "
         "(hivemind.average_opt_statistics)")
      ->delimiter(',');
  add_switch(app, flags, "--client_mode", hm("client_mode"), true,
             "hivemind.client_mode: no inbound connections (behind a firewall or NAT)");
  add_switch(app, flags, "--assist_in_averaging", hm("assist_in_averaging"), true,
             "hivemind.assist_in_averaging: an auxiliary peer; trains nothing, reduces a share of every averaging "
             "round by its --bandwidth (with weight 0), so client-mode peers can average through it");
  add_switch(app, flags, "--delay_optimizer_step", hm("delay_optimizer_step"), true,
             "hivemind.delay_optimizer_step: each update runs in the background, one step stale (needs the "
             "config key hivemind.offload_optimizer; --offload_optimizer is ZeRO's)");
}

bool parse_cli(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return true;
  } catch (const CLI::Success& e) {  // --help, --help-all, --version
    app.exit(e);
    std::cout.flush();
    return false;
  } catch (const CLI::ParseError& e) {
    throw InputError(std::string("command line: ") + e.what() + " (see --help)");
  }
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
  json merged = apply_overrides(doc, flags.overrides, world_size);
  // A data-parallel run that starts itself under `launch` does it before its config is
  // resolved: the batch triple is checked in the ranks, at the world launch gives them.
  if (world_size < 1) self_launch_if_asked(self_launch_options(merged));
  return config_from_json(merged, origin, world_size);
}

}  // namespace polytrain
