// FlagAI's self-launching Trainer: a data-parallel job started as a plain program (no launcher
// around it) that asks for more than one process re-executes itself under `launch`, as if the
// user had typed `launch [options] PROGRAM ARGS`. Torch-free, so it is testable on its own.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "polytrain/common/config.h"

namespace polytrain {

/// What the decision needs from the process, so tests can give it samples.
struct ProcessView {
  std::vector<std::string> argv;  ///< this process's arguments, argv[0] included (/proc/self/cmdline)
  std::string exe;                ///< this program's absolute path (/proc/self/exe)
  bool under_launcher = false;    ///< a launcher's world is in the environment (dist_env.h)
  /// Finds the `launch` program: POLYTRAIN_LAUNCH, else next to `exe`, else on PATH ("" = none).
  std::function<std::string()> find_launch;
};

/// The command line this process re-executes as, or nullopt when it runs as it is. It does when
/// env_type is pytorchDDP, deepspeed or deepspeed+mpu, no launcher started it, and num_gpus > 1,
/// num_nodes > 0 or a hostfile is given (trainer section or flags: FlagAI's names). The result is
/// `launch [--hostfile F] [--num_nodes N] [--num_gpus G] [--master_addr A] [--master_port P] --
/// PROGRAM ARGS...`, PROGRAM being trainer.training_script when set, else this program.
/// InputError (one line) when it should and `launch` is nowhere to be found.
std::optional<std::vector<std::string>> self_launch_command(const TrainerOptions& t, const ProcessView& p);

/// The keys self_launch_command reads, from a config document's trainer section (FlagAI's names,
/// master_addr for master_ip); a key of the wrong type is left at its default for
/// config_from_json to report.
TrainerOptions self_launch_options(const nlohmann::json& doc);

/// This process, as /proc and the environment show it.
ProcessView this_process();

/// self_launch_command for this process; when there is one, prints it as the run's first line,
/// and execv's it (the pid, and so the signals sent to it and its exit code, become launch's).
/// Returns only when the process runs as it is. InputError when exec fails.
void self_launch_if_asked(const TrainerOptions& t);

}  // namespace polytrain
