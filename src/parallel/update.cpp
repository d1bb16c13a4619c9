// The shared update (see update.h): scale, norm over the ranks holding distinct pieces, skip
// or clip, step.
#include "polytrain/parallel/update.h"

#include <cmath>

#include <torch/torch.h>

#include "polytrain/parallel/backend.h"
#include "polytrain/trainer/optimizers.h"

namespace polytrain {

double grad_sq_sum(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> sums;
  sums.reserve(params.size());
  for (const auto& p : params)
    if (p.grad().defined()) sums.push_back(p.grad().to(torch::kDouble).pow(2).sum());
  if (sums.empty()) return 0.0;
  return torch::stack(sums).sum().item<double>();
}

double grad_norm(const std::vector<at::Tensor>& params) { return std::sqrt(grad_sq_sum(params)); }

void clip_grads(const std::vector<at::Tensor>& params, double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return;
  const double coef = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s formula
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(coef);
}

UpdateOptions update_options(const StepRequest& request, double clip) {
  UpdateOptions o;
  o.lr = request.lr;
  o.beta1 = request.beta1;
  o.clip = clip;
  o.grad_scale = 1.0 / request.loss_scale;
  return o;
}

StepResult step_result(const UpdateOutcome& u, int64_t step, int64_t samples) {
  StepResult r;
  r.outcome = u.applied ? StepOutcome::kApplied : StepOutcome::kSkippedNonFinite;
  r.grad_norm = u.grad_norm;
  r.global_step = step + 1;
  r.samples = samples;
  return r;
}

UpdateOutcome apply_update(const std::vector<at::Tensor>& params, Optimizer& opt, const UpdateOptions& o,
                           const SquaredNormReducer& reduce, const std::vector<at::Tensor>* norm_params) {
  if (o.grad_scale != 1.0) {  // unscale first: the norm, clipping and the update see true gradients
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(o.grad_scale);
  }
  double sq = grad_sq_sum(norm_params ? *norm_params : params);
  if (reduce) sq = reduce(sq);
  UpdateOutcome out;
  out.grad_norm = std::sqrt(sq);
  out.applied = std::isfinite(out.grad_norm);
  if (!out.applied) return out;
  clip_grads(params, out.grad_norm, o.clip);
  opt.set_lr(o.lr);
  if (o.beta1) opt.set_beta1(*o.beta1);
  opt.step();
  return out;
}

}  // namespace polytrain
