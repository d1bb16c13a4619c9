// The experiment folder DeepSpeed's masked-LM tutorial recommends:
// {experiments_dir}/{exp_type}.{YYYY}.{MM}.{DD}.{HH}.{MM}.{SS}.{uuid}/{experiment_name}/
// with hparams.json, githash.log and gitdiff.log. Metrics and checkpoints are written by others.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"

namespace polytrain {

/// Creates the folder (InputError if it cannot) and writes the three reproducibility files.
/// Returns the path of {...}/{experiment_name}.
std::string create_experiment_dir(const TrainerOptions& opts, const nlohmann::json& hparams);

/// A random RFC 4122 version-4 UUID string.
std::string make_uuid4();

}  // namespace polytrain
