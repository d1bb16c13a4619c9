// DiLoCo's outer optimizer (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
// Language Models", arXiv 2311.08105), as hivemind.outer_optimizer configures it: the outer
// parameters and the outer momentum, fp32 on the CPU in one flat vector each. This file holds the
// math (pseudo-gradient, SGD / Nesterov step) and the key's parsing; when the rounds run and what
// the swarm serves are the backend's (hivemind_backend.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

namespace polytrain::hivemind {

/// Where a donated state's optimizer archive and a checkpoint's shard keep the outer momentum.
inline constexpr const char* kOuterMomentumKey = "hivemind_outer_momentum";

/// hivemind.outer_optimizer: {"type": "nesterov" | "sgd", "params": {...}}.
struct OuterOptimizerOptions {
  std::string type = "nesterov";  ///< "nesterov" (DiLoCo's) or "sgd"
  double lr = 0.7;                ///< nesterov 0.7 (DiLoCo's), sgd 1.0 (plain averaging of the local models)
  double momentum = 0.9;          ///< nesterov 0.9, sgd 0
  bool nesterov = true;
};

/// The options of `section` (the hivemind section as given), nullopt when it has no
/// outer_optimizer. InputError naming hivemind.outer_optimizer's key for anything else.
std::optional<OuterOptimizerOptions> parse_outer_optimizer(const nlohmann::json& section);

/// The outer step of torch.optim.SGD(lr, momentum, nesterov) over the pseudo-gradient
/// delta = outer - local: buf = momentum * buf + delta (buf starts at 0, so the first is delta);
/// d = nesterov ? delta + momentum * buf : (momentum > 0 ? buf : delta); outer -= lr * d.
class OuterOptimizer {
 public:
  explicit OuterOptimizer(OuterOptimizerOptions o) : o_(std::move(o)) {}
  const OuterOptimizerOptions& options() const { return o_; }
  /// The outer parameters take `params`' values (in fp32); the momentum is kept (zeros the first time).
  void reset(const std::vector<at::Tensor>& params);
  int64_t numel() const;
  /// outer - params into flat[0, numel()), fp32.
  void pseudo_gradient(const std::vector<at::Tensor>& params, at::Tensor& flat) const;
  /// One outer step with the averaged pseudo-gradient `delta` (fp32, numel() values).
  void step(const at::Tensor& delta);
  /// The outer parameters into `params` (each in its own dtype and device).
  void copy_to(const std::vector<at::Tensor>& params) const;
  /// The outer parameters in `params`' shapes (fp32 views of the flat vector).
  std::vector<at::Tensor> views(const std::vector<at::Tensor>& params) const;
  const at::Tensor& momentum() const { return momentum_; }
  /// Replaces the momentum; InputError naming `origin` when it is not numel() finite fp32 values.
  void load_momentum(const at::Tensor& m, const std::string& origin);

 private:
  OuterOptimizerOptions o_;
  at::Tensor outer_;     ///< flat fp32
  at::Tensor momentum_;  ///< flat fp32
};

}  // namespace polytrain::hivemind
