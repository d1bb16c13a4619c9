// Builds the optimizer named by the config (DeepSpeed's names, torch.optim's semantics) over
// named parameters with the usual no-decay group, and sets LR / beta1 on it as a schedule
// asks. Which LR to set when is lr_schedule.h's business; stepping it is the backend's.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

namespace polytrain {

struct OptimizerConfig;

/// Builds the optimizer from the config over named parameters; parameters whose name contains
/// any of cfg.no_decay substrings (biases, LayerNorm weights) go into a second group with
/// weight_decay 0. Group 0 holds the decayed parameters, group 1 the others; a group that
/// would be empty is left out. A tensor listed twice (tied weights) is kept once, under its
/// first name; tensors that do not require grad are left out.
/// type (case-insensitive):
///   "AdamW", or "Adam" with adam_w_mode -> torch::optim::AdamW (decoupled decay)
///   "Adam" with adam_w_mode=false       -> torch::optim::Adam (L2 decay added to the gradient)
///   "SGD" -> torch::optim::SGD, "Adagrad" -> torch::optim::Adagrad, "Lamb" -> polytrain::Lamb
/// bias_correction=false is honoured by Lamb (its `debias`) and is an InputError for Adam/AdamW,
/// whose libtorch implementations always correct (as torch.optim's do). Other bad values
/// (unknown type, negative lr, beta outside [0, 1), amsgrad outside Adam) are InputError
/// naming the optimizer.params key.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const OptimizerConfig& cfg, const std::vector<std::pair<std::string, torch::Tensor>>& named_params);

/// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::Optimizer& opt, double lr);

/// Sets beta1 of every group of an Adam, AdamW or Lamb optimizer (OneCycle's momentum), keeping
/// beta2; no-op for other optimizers (as DeepSpeed's OneCycle, which cycles only `betas`).
/// InputError when beta1 is outside [0, 1) (OneCycle's decay_mom_rate can push it there).
void set_beta1(torch::optim::Optimizer& opt, double beta1);

}  // namespace polytrain
