// OuterOptimizer: hivemind.outer_optimizer's parsing and DiLoCo's outer step on flat fp32 vectors.
#include "polytrain/parallel/hivemind/outer_optimizer.h"

#include <cmath>

#include <ATen/ATen.h>

#include "polytrain/common/error.h"

namespace polytrain::hivemind {

namespace {

const char* const kKey = "hivemind.outer_optimizer";

double number(const nlohmann::json& params, const char* key, double fallback) {
  if (!params.contains(key)) return fallback;
  const auto& v = params[key];
  PT_INPUT_CHECK(v.is_number(), kKey, ".params.", key, ": must be a number, got ", v.dump());
  return v.get<double>();
}

}  // namespace

std::optional<OuterOptimizerOptions> parse_outer_optimizer(const nlohmann::json& section) {
  if (!section.is_object() || !section.contains("outer_optimizer") || section["outer_optimizer"].is_null())
    return std::nullopt;
  const auto& j = section["outer_optimizer"];
  PT_INPUT_CHECK(j.is_object(), kKey, ": must be an object such as {\"type\": \"nesterov\", \"params\": {\"lr\": 0.7, "
                 "\"momentum\": 0.9}}, got ", j.dump());
  for (const auto& item : j.items())
    PT_INPUT_CHECK(item.key() == "type" || item.key() == "params", kKey, ": unknown key '", item.key(),
                   "' (expected type and params)");
  PT_INPUT_CHECK(j.contains("type") && j["type"].is_string(), kKey, ".type: must be \"nesterov\" or \"sgd\"");
  OuterOptimizerOptions o;
  o.type = j["type"].get<std::string>();
  PT_INPUT_CHECK(o.type == "nesterov" || o.type == "sgd", kKey, ".type: must be \"nesterov\" or \"sgd\", got \"",
                 o.type, "\"");
  const bool sgd = o.type == "sgd";
  const nlohmann::json params = j.contains("params") ? j["params"] : nlohmann::json::object();
  PT_INPUT_CHECK(params.is_object(), kKey, ".params: must be an object, got ", params.dump());
  for (const auto& item : params.items())
    PT_INPUT_CHECK(item.key() == "lr" || item.key() == "momentum" || (sgd && item.key() == "nesterov"), kKey,
                   ".params: unknown key '", item.key(), "' (", o.type, " takes lr, momentum",
                   sgd ? ", nesterov" : "", ")");
  o.lr = number(params, "lr", sgd ? 1.0 : 0.7);
  o.momentum = number(params, "momentum", sgd ? 0.0 : 0.9);
  o.nesterov = !sgd;
  if (sgd && params.contains("nesterov")) {
    PT_INPUT_CHECK(params["nesterov"].is_boolean(), kKey, ".params.nesterov: must be true or false");
    o.nesterov = params["nesterov"].get<bool>();
  }
  PT_INPUT_CHECK(o.lr > 0 && std::isfinite(o.lr), kKey, ".params.lr: must be a finite number > 0, got ", o.lr);
  PT_INPUT_CHECK(o.momentum >= 0 && o.momentum < 1, kKey, ".params.momentum: must be in [0, 1), got ", o.momentum);
  // torch.optim.SGD's rule: Nesterov's look-ahead needs a momentum.
  PT_INPUT_CHECK(!o.nesterov || o.momentum > 0, kKey, ".params.momentum: Nesterov needs a momentum > 0");
  return o;
}

void OuterOptimizer::reset(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  if (!outer_.defined() || outer_.numel() != n) outer_ = at::empty({n}, at::kFloat);
  if (!momentum_.defined() || momentum_.numel() != n) momentum_ = at::zeros({n}, at::kFloat);
  int64_t off = 0;
  for (const auto& p : params) {
    outer_.narrow(0, off, p.numel()).copy_(p.detach().reshape({-1}));
    off += p.numel();
  }
}

int64_t OuterOptimizer::numel() const { return outer_.defined() ? outer_.numel() : 0; }

void OuterOptimizer::pseudo_gradient(const std::vector<at::Tensor>& params, at::Tensor& flat) const {
  int64_t off = 0;
  for (const auto& p : params) {
    auto dst = flat.narrow(0, off, p.numel());
    dst.copy_(outer_.narrow(0, off, p.numel()));
    dst.sub_(p.detach().reshape({-1}).to(at::kCPU, at::kFloat));
    off += p.numel();
  }
}

void OuterOptimizer::step(const at::Tensor& delta) {
  // torch.optim.SGD's order of operations (dampening 0), so its results can be compared bit for bit.
  at::Tensor d = delta;
  if (o_.momentum > 0) {
    momentum_.mul_(o_.momentum).add_(delta);
    d = o_.nesterov ? delta.add(momentum_, o_.momentum) : momentum_;
  }
  outer_.add_(d, -o_.lr);
}

void OuterOptimizer::copy_to(const std::vector<at::Tensor>& params) const {
  int64_t off = 0;
  for (const auto& p : params) {
    p.detach().copy_(outer_.narrow(0, off, p.numel()).view(p.sizes()));
    off += p.numel();
  }
}

std::vector<at::Tensor> OuterOptimizer::views(const std::vector<at::Tensor>& params) const {
  std::vector<at::Tensor> out;
  int64_t off = 0;
  for (const auto& p : params) {
    out.push_back(outer_.narrow(0, off, p.numel()).view(p.sizes()));
    off += p.numel();
  }
  return out;
}

void OuterOptimizer::load_momentum(const at::Tensor& m, const std::string& origin) {
  PT_INPUT_CHECK(m.defined() && m.scalar_type() == at::kFloat && m.dim() == 1 && m.numel() == numel(), origin,
                 ": the outer momentum is not ", numel(), " fp32 values (another model in the same run_id?)");
  PT_INPUT_CHECK(at::isfinite(m).all().item<bool>(), origin, ": the outer momentum has non-finite values");
  momentum_.copy_(m);
}

}  // namespace polytrain::hivemind
