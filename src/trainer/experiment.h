// The experiment folder of a run, DeepSpeed's masked-LM tutorial layout with a readable stamp:
// {experiments_dir}/{exp_type}.{YYYY}.{MM}.{DD}.{HH}.{MM}.{SS}.{experiment_name}/{experiment_name}/
// (".2", ".3", ... after the stamp only when two runs start in the same second) with
// hparams.json, githash.log and gitdiff.log. A resumed run appends to the folder of the run it
// resumes. Metrics and checkpoints are written by others.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace polytrain {

/// Creates the folder (InputError if it cannot) and writes the three reproducibility files.
/// Returns the path of {...}/{experiment_name}.
std::string create_experiment_dir(const TrainerOptions& opts, const nlohmann::json& hparams);

/// The folder of the run whose checkpoints trainer.load_dir holds, when this run continues it:
/// the one recorded in the latest checkpoint's complete.json (`recorded`, "" when none), else
/// load_dir's parent when load_dir is an experiment's `checkpoints/`; only a folder that exists
/// and carries this run's experiment_name. "" otherwise (the run gets a new folder).
std::string continued_experiment_dir(const TrainerOptions& opts, const std::string& recorded);

/// Removes a folder create_experiment_dir made, with its stamped parent (a run that failed
/// before its first step leaves nothing behind).
void remove_experiment_dir(const std::string& dir);

}  // namespace polytrain
