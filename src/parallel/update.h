// The update every backend makes once its gradients are final, in one place: unscale, the
// global gradient norm and finite check, clipping by that norm, LR / beta1, optimizer step.
// Backends differ only in which gradient pieces a rank holds; they say how to sum the squared
// norm over the ranks that hold distinct pieces (DDP: nobody, every rank has all of it; ZeRO:
// the data-parallel group; tensor parallel: the tensor-parallel group, replicated parameters
// counted on one rank only). A non-finite piece anywhere makes the sum non-finite everywhere,
// so every rank takes the same skip decision from one reduction.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain {

class Optimizer;
struct StepRequest;
struct StepResult;

/// Sum of the squares of the gradients of `params` (those with a gradient), in float64 so the
/// result does not depend on float32 summation order; one host sync for the whole list.
double grad_sq_sum(const std::vector<at::Tensor>& params);

/// L2 norm: sqrt(grad_sq_sum(params)).
double grad_norm(const std::vector<at::Tensor>& params);

/// Scales every gradient by max_norm / (norm + 1e-6) when norm > max_norm (torch's
/// clip_grad_norm_). max_norm <= 0: off.
void clip_grads(const std::vector<at::Tensor>& params, double norm, double max_norm);

/// Local sum of squares -> the global one (identity when every rank holds every gradient).
using SquaredNormReducer = std::function<double(double local_sq_sum)>;

struct UpdateOptions {
  double lr = 0.0;
  std::optional<double> beta1;  ///< set when the schedule cycles momentum
  double clip = 0.0;            ///< gradient_clipping, 0 = off
  /// Gradients are multiplied by this before anything else: 1 / (fp16 loss scale) times any
  /// normalisation the backend owes (e.g. expected / actual samples of an elastic step).
  double grad_scale = 1.0;
};

struct UpdateOutcome {
  bool applied = false;     ///< false: non-finite gradient norm, nothing updated (on every rank)
  double grad_norm = 0.0;   ///< global norm before clipping
};

/// The options of the loop's request (lr, beta1, 1 / loss scale) with gradient_clipping `clip`.
UpdateOptions update_options(const StepRequest& request, double clip);

/// What step() reports for update `u` after `step` steps, `samples` samples over all ranks.
StepResult step_result(const UpdateOutcome& u, int64_t step, int64_t samples);

/// The shared update over this rank's gradient holders `params` (what `opt` steps).
/// `norm_params` (default: `params`) are the tensors whose gradients count toward the norm
/// on this rank; `reduce` sums the squared norm over ranks (default: none). Gradients are
/// left for the caller to clear.
UpdateOutcome apply_update(const std::vector<at::Tensor>& params, Optimizer& opt, const UpdateOptions& o,
                           const SquaredNormReducer& reduce = {}, const std::vector<at::Tensor>* norm_params = nullptr);

}  // namespace polytrain
