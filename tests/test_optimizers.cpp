// make_optimizer / Lamb against golden trajectories from scripts/gen_golden_optim.py
// (torch.optim 1.13 and torch_optimizer's LAMB), the no-decay grouping, save/load through
// torch::serialize archives, the LR/beta1 setters, and input errors.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/lamb.h"
#include "polytrain/optim/multi_tensor_adam.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {
namespace {

using nlohmann::json;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

const json& golden() {
  static const json doc = [] {
    const std::string path = std::string(POLYTRAIN_SOURCE_DIR) + "/tests/golden/optimizers.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("missing " + path + " (run scripts/gen_golden_optim.py)");
    return json::parse(in);
  }();
  return doc;
}

Named initial_params() {
  Named out;
  for (const auto& p : golden().at("params")) {
    auto values = p.at("init").get<std::vector<double>>();
    auto shape = p.at("shape").get<std::vector<int64_t>>();
    auto t = torch::tensor(values, torch::kFloat64).to(torch::kFloat32).reshape(shape);
    out.emplace_back(p.at("name").get<std::string>(), t.requires_grad_(true));
  }
  return out;
}

Named clone_params(const Named& from) {
  Named out;
  for (const auto& [n, p] : from) out.emplace_back(n, p.detach().clone().requires_grad_(true));
  return out;
}

OptimizerConfig optimizer_from(const json& c) {
  OptimizerConfig o;
  o.no_decay = golden().at("no_decay").get<std::vector<std::string>>();
  for (const auto& [key, v] : c.items()) {
    if (key == "type") o.type = v.get<std::string>();
    else if (key == "lr") o.lr = v.get<double>();
    else if (key == "beta1") o.beta1 = v.get<double>();
    else if (key == "beta2") o.beta2 = v.get<double>();
    else if (key == "eps") o.eps = v.get<double>();
    else if (key == "weight_decay") o.weight_decay = v.get<double>();
    else if (key == "adam_w_mode") o.adam_w_mode = v.get<bool>();
    else if (key == "bias_correction") o.bias_correction = v.get<bool>();
    else if (key == "clamp_value") o.clamp_value = v.get<double>();
    else if (key == "amsgrad") o.amsgrad = v.get<bool>();
    else if (key == "momentum") o.momentum = v.get<double>();
    else if (key == "dampening") o.dampening = v.get<double>();
    else if (key == "nesterov") o.nesterov = v.get<bool>();
    else if (key == "lr_decay") o.lr_decay = v.get<double>();
    else if (key == "initial_accumulator_value") o.initial_accumulator_value = v.get<double>();
    else ADD_FAILURE() << "golden file has an unknown optimizer key " << key;
  }
  return o;
}

/// The script's gradient: float32(0.3 cos(0.37 i + 1.3 j + 0.61 t)) + 0.05 p.
void set_gradients(Named& params, int t) {
  torch::NoGradGuard no_grad;
  for (size_t j = 0; j < params.size(); ++j) {
    auto& p = params[j].second;
    std::vector<double> base(p.numel());
    for (size_t i = 0; i < base.size(); ++i) base[i] = 0.3 * std::cos(0.37 * i + 1.3 * j + 0.61 * t);
    p.mutable_grad() = torch::tensor(base, torch::kFloat64).to(torch::kFloat32).reshape(p.sizes()) + 0.05 * p;
  }
}

/// One step of a golden case: the schedule's LR (and beta1), gradients, update.
void golden_step(const json& c, torch::optim::Optimizer& opt, Named& params, int t) {
  set_learning_rate(opt, c.at("lrs").at(t - 1).get<double>());
  if (!c.at("beta1s").is_null()) set_beta1(opt, c.at("beta1s").at(t - 1).get<double>());
  set_gradients(params, t);
  opt.step();
}

void expect_matches(const json& c, const Named& params, int t) {
  const auto& want = c.at("after_step").at(t - 1);
  for (size_t j = 0; j < params.size(); ++j) {
    auto got = params[j].second.detach().reshape(-1);
    auto w = want.at(j).get<std::vector<double>>();
    ASSERT_EQ(got.numel(), static_cast<int64_t>(w.size()));
    for (size_t i = 0; i < w.size(); ++i) {
      const double g = got[i].item<double>();
      EXPECT_NEAR(g, w[i], 1e-6 * std::fabs(w[i]) + 1e-8)
          << c.at("name").get<std::string>() << " step " << t << " " << params[j].first << "[" << i << "]";
    }
  }
}

TEST(Optimizers, MatchTorchGolden) {
  ASSERT_EQ(golden().at("cases").size(), 7u);
  for (const auto& c : golden().at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    auto params = initial_params();
    auto opt = make_torch_optimizer(optimizer_from(c.at("config")), params);
    for (int t = 1; t <= 5; ++t) {
      golden_step(c, *opt, params, t);
      expect_matches(c, params, t);
    }
  }
}

TEST(Optimizers, NoDecayGroupAndTypes) {
  auto params = initial_params();
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  auto opt = make_torch_optimizer(cfg, params);
  EXPECT_NE(dynamic_cast<torch::optim::AdamW*>(opt.get()), nullptr);
  ASSERT_EQ(opt->param_groups().size(), 2u);
  const auto& decay = opt->param_groups()[0];
  const auto& no_decay = opt->param_groups()[1];
  ASSERT_EQ(decay.params().size(), 3u);  // encoder.weight, big.weight, head.weight
  ASSERT_EQ(no_decay.params().size(), 2u);  // encoder.bias, encoder.LayerNorm.weight
  EXPECT_TRUE(decay.params()[0].is_same(params[0].second));
  EXPECT_TRUE(no_decay.params()[0].is_same(params[1].second));
  EXPECT_TRUE(no_decay.params()[1].is_same(params[2].second));
  EXPECT_EQ(static_cast<const torch::optim::AdamWOptions&>(decay.options()).weight_decay(), 0.1);
  EXPECT_EQ(static_cast<const torch::optim::AdamWOptions&>(no_decay.options()).weight_decay(), 0.0);

  // a tied weight listed twice is kept once; frozen tensors are left out
  Named tied = {{"emb.weight", params[0].second}, {"lm_head.weight", params[0].second},
                {"frozen.weight", torch::ones({2})}};
  auto tied_opt = make_torch_optimizer(cfg, tied);
  ASSERT_EQ(tied_opt->param_groups().size(), 1u);
  EXPECT_EQ(tied_opt->param_groups()[0].params().size(), 1u);

  cfg.adam_w_mode = false;
  cfg.type = "Adam";
  EXPECT_NE(dynamic_cast<torch::optim::Adam*>(make_torch_optimizer(cfg, params).get()), nullptr);
  cfg.type = "adamw";  // AdamW is decoupled whatever adam_w_mode says
  EXPECT_NE(dynamic_cast<torch::optim::AdamW*>(make_torch_optimizer(cfg, params).get()), nullptr);
  cfg.type = "LAMB";
  EXPECT_NE(dynamic_cast<Lamb*>(make_torch_optimizer(cfg, params).get()), nullptr);
  cfg.type = "sgd";
  EXPECT_NE(dynamic_cast<torch::optim::SGD*>(make_torch_optimizer(cfg, params).get()), nullptr);
  cfg.type = "Adagrad";
  EXPECT_NE(dynamic_cast<torch::optim::Adagrad*>(make_torch_optimizer(cfg, params).get()), nullptr);
}

TEST(Optimizers, SettersReachEveryGroup) {
  auto params = initial_params();
  OptimizerConfig cfg;
  cfg.type = "Lamb";
  auto opt = make_torch_optimizer(cfg, params);
  set_learning_rate(*opt, 0.25);
  set_beta1(*opt, 0.7);
  for (const auto& g : opt->param_groups()) {
    const auto& o = static_cast<const LambOptions&>(g.options());
    EXPECT_EQ(o.lr(), 0.25);
    EXPECT_EQ(std::get<0>(o.betas()), 0.7);
    EXPECT_EQ(std::get<1>(o.betas()), cfg.beta2);
  }
  EXPECT_THROW(set_beta1(*opt, 1.05), InputError);
  cfg.type = "SGD";
  auto sgd = make_torch_optimizer(cfg, params);
  // No beta1: a schedule cycling momentum on SGD is an error, not a silent no-op.
  try {
    set_beta1(*sgd, 0.85);
    ADD_FAILURE() << "set_beta1 on SGD did not throw";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cycle_momentum"), std::string::npos) << e.what();
  }
  set_learning_rate(*sgd, 0.5);
  EXPECT_EQ(sgd->param_groups()[1].options().get_lr(), 0.5);
}

// Values by hand: w = [3, 4], g = [1, 1], lr 0.1, eps 0, no decay, no debias. After one step
// m = 0.1 g, v = 0.001 g^2, u = m / sqrt(v) = sqrt(10) each, ||u|| = sqrt(20), so every
// element moves by lr * min(||w||, clamp) / sqrt(2).
TEST(Lamb, TrustRatioByHand) {
  for (double clamp : {10.0, 1.0}) {
    auto w = torch::tensor({3.0f, 4.0f}).requires_grad_(true);
    auto z = torch::zeros({2}).requires_grad_(true);  // ||w|| = 0 -> trust 1: moves by lr * u
    Lamb opt({w, z}, LambOptions(0.1).eps(0.0).clamp_value(clamp));
    w.mutable_grad() = torch::ones({2});
    z.mutable_grad() = torch::ones({2});
    opt.step();
    const double d = 0.1 * std::min(5.0, clamp) / std::sqrt(2.0);
    EXPECT_NEAR(w[0].item<double>(), 3.0 - d, 1e-6);
    EXPECT_NEAR(w[1].item<double>(), 4.0 - d, 1e-6);
    EXPECT_NEAR(z[0].item<double>(), -0.1 * std::sqrt(10.0), 1e-6);
  }
}

// Save after 2 steps, load into a fresh optimizer over fresh tensors, run 3 more steps: the
// result must equal the uninterrupted run bit for bit (and still match the golden values).
TEST(Optimizers, SaveLoadContinuesIdentically) {
  for (const auto& c : golden().at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    const auto cfg = optimizer_from(c.at("config"));
    auto params = initial_params();
    auto opt = make_torch_optimizer(cfg, params);
    for (int t = 1; t <= 2; ++t) golden_step(c, *opt, params, t);

    std::stringstream buffer;
    {
      torch::serialize::OutputArchive archive;
      opt->save(archive);
      archive.save_to(buffer);
    }
    auto resumed = clone_params(params);
    auto opt2 = make_torch_optimizer(cfg, resumed);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(buffer);
      opt2->load(archive);
    }
    for (int t = 3; t <= 5; ++t) {
      golden_step(c, *opt, params, t);
      golden_step(c, *opt2, resumed, t);
    }
    for (size_t j = 0; j < params.size(); ++j)
      EXPECT_TRUE(torch::equal(params[j].second, resumed[j].second)) << params[j].first;
    expect_matches(c, resumed, 5);
  }
}

// foreach: the per-parameter loop's arithmetic over whole lists (on the CPU the same values
// bit for bit), against the golden trajectories; state interchangeable with the loop's.
TEST(Optimizers, ForeachAdamMatchesTheGoldenAndThePerParameterLoop) {
  int cases = 0;
  for (const auto& c : golden().at("cases")) {
    auto cfg = optimizer_from(c.at("config"));
    const std::string type = c.at("config").at("type").get<std::string>();
    if ((type != "Adam" && type != "AdamW") || cfg.amsgrad) continue;
    SCOPED_TRACE(c.at("name").get<std::string>());
    ++cases;
    auto params = initial_params(), looped = initial_params();
    auto foreach_cfg = cfg, loop_cfg = cfg;
    foreach_cfg.foreach = true;
    loop_cfg.foreach = false;
    auto opt = make_optimizer(foreach_cfg, split_by_decay(foreach_cfg, params));
    auto loop = make_optimizer(loop_cfg, split_by_decay(loop_cfg, looped));
    auto step = [&](Optimizer& o, Named& p, int t) {
      o.set_lr(c.at("lrs").at(t - 1).get<double>());
      if (!c.at("beta1s").is_null()) o.set_beta1(c.at("beta1s").at(t - 1).get<double>());
      set_gradients(p, t);
      o.step();
    };
    for (int t = 1; t <= 3; ++t) {
      step(*opt, params, t);
      step(*loop, looped, t);
      expect_matches(c, params, t);
      for (size_t j = 0; j < params.size(); ++j)
        EXPECT_TRUE(torch::equal(params[j].second, looped[j].second)) << params[j].first << " step " << t;
    }
    // The foreach optimizer's state continues in the loop, and the loop's in foreach.
    std::stringstream a, b;
    {
      torch::serialize::OutputArchive oa, ob;
      opt->save(oa), loop->save(ob);
      oa.save_to(a), ob.save_to(b);
    }
    auto p2 = clone_params(params), l2 = clone_params(looped);
    auto opt2 = make_optimizer(loop_cfg, split_by_decay(loop_cfg, p2));
    auto loop2 = make_optimizer(foreach_cfg, split_by_decay(foreach_cfg, l2));
    {
      torch::serialize::InputArchive ia, ib;
      ia.load_from(a), ib.load_from(b);
      opt2->load(ia, "foreach state"), loop2->load(ib, "loop state");
    }
    for (int t = 4; t <= 5; ++t) step(*opt2, p2, t), step(*loop2, l2, t);
    expect_matches(c, p2, 5);
    expect_matches(c, l2, 5);
  }
  EXPECT_GE(cases, 2);
}

TEST(Optimizers, FusedAndForeachSettings) {
  OptimizerConfig cfg;
  auto params = initial_params();
  cfg.fused = true;
  cfg.foreach = true;
  EXPECT_THROW(
      {
        try {
          make_optimizer(cfg, split_by_decay(cfg, params));
        } catch (const InputError& e) {
          EXPECT_NE(std::string(e.what()).find("fused and foreach cannot both be true"), std::string::npos) << e.what();
          throw;
        }
      },
      InputError);
  cfg.foreach.reset();
  if (!fused_adam_available()) {  // LibTorch 1.x: said so, with what to use instead
    try {
      make_optimizer(cfg, split_by_decay(cfg, params));
      ADD_FAILURE() << "fused accepted without the kernel";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer.params.fused needs LibTorch >= 2.0"), std::string::npos) << e.what();
    }
  }
  cfg.fused.reset();
  cfg.foreach = true;
  cfg.amsgrad = true;
  EXPECT_THROW(make_optimizer(cfg, split_by_decay(cfg, params)), InputError);
  // The JSON keys: booleans or null, Adam/AdamW only.
  auto parse = [](const std::string& params) {
    return config_from_json(json::parse(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": )" + params + "}}"),
                            "cfg.json");
  };
  EXPECT_EQ(parse(R"({"fused": true})").optimizer.fused, std::optional<bool>(true));
  EXPECT_FALSE(parse(R"({"foreach": null})").optimizer.foreach.has_value());
  EXPECT_THROW(parse(R"({"fused": "yes"})"), InputError);
}

TEST(Optimizers, LambStateRoundTrips) {
  auto params = initial_params();
  OptimizerConfig cfg;
  cfg.type = "Lamb";
  auto opt = make_torch_optimizer(cfg, params);
  set_gradients(params, 1);
  opt->step();
  std::stringstream buffer;
  torch::serialize::OutputArchive out;
  opt->save(out);
  out.save_to(buffer);
  auto opt2 = make_torch_optimizer(cfg, params);  // same tensors: same state keys
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  opt2->load(in);
  ASSERT_EQ(opt2->state().size(), params.size());
  for (const auto& [key, state] : opt->state()) {
    const auto& a = static_cast<const LambParamState&>(*state);
    const auto& b = static_cast<const LambParamState&>(*opt2->state().at(key));
    EXPECT_TRUE(a == b);
    EXPECT_EQ(b.step(), 1);
  }
}

// polytrain's Optimizer: state saved by parameter name loads into an optimizer built over fresh
// tensors registered in another order, and the two continue bit for bit; a state for another
// model is refused naming the parameter.
TEST(Optimizers, StateByNameSurvivesAnotherParameterOrder) {
  for (const auto& c : golden().at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    const auto cfg = optimizer_from(c.at("config"));
    auto params = initial_params();
    auto opt = make_optimizer(cfg, split_by_decay(cfg, params));
    std::string type = cfg.type;
    for (char& ch : type) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    EXPECT_EQ(opt->has_beta1(), type == "adam" || type == "adamw" || type == "lamb") << type;
    for (int t = 1; t <= 2; ++t) golden_step(c, opt->torch_optimizer(), params, t);
    torch::serialize::OutputArchive out;
    opt->save(out);
    std::stringstream buffer;
    out.save_to(buffer);
    auto resumed = clone_params(params);
    Named reversed(resumed.rbegin(), resumed.rend());
    auto opt2 = make_optimizer(cfg, split_by_decay(cfg, reversed));
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    opt2->load(in, "test");
    for (int t = 3; t <= 5; ++t) {
      golden_step(c, opt->torch_optimizer(), params, t);
      golden_step(c, opt2->torch_optimizer(), resumed, t);
    }
    for (size_t j = 0; j < params.size(); ++j)
      EXPECT_TRUE(torch::equal(params[j].second, resumed[j].second)) << params[j].first;
  }
  auto params = initial_params();
  OptimizerConfig cfg;
  auto opt = make_optimizer(cfg, split_by_decay(cfg, params));
  torch::serialize::OutputArchive out;
  opt->save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  Named renamed = clone_params(params);
  renamed[0].first = "other.weight";
  auto opt2 = make_optimizer(cfg, split_by_decay(cfg, renamed));
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  try {
    opt2->load(in, "ckpt/shard_0.pt");
    ADD_FAILURE() << "loaded a state for another model";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'other.weight'"), std::string::npos) << e.what();
  }
}

// hivemind.average_opt_statistics reads and writes these: each optimizer's per-parameter state
// by torch.optim's names, the optimizer's own storage (not a copy).
TEST(Optimizers, StatisticsAreTheStateByTorchsNamesAndShareItsStorage) {
  struct Case {
    const char* type;
    double momentum;
    std::vector<std::string> names;
  };
  const std::vector<Case> cases = {{"AdamW", 0, {"exp_avg", "exp_avg_sq"}}, {"Adam", 0, {"exp_avg", "exp_avg_sq"}},
                                   {"Lamb", 0, {"exp_avg", "exp_avg_sq"}},  {"CPUAdam", 0, {"exp_avg", "exp_avg_sq"}},
                                   {"SGD", 0.9, {"momentum_buffer"}},       {"Adagrad", 0, {"sum"}}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.type);
    OptimizerConfig cfg;
    cfg.type = c.type;
    cfg.momentum = c.momentum;
    EXPECT_EQ(optimizer_statistics(cfg), c.names);
    auto params = initial_params();
    auto opt = make_optimizer(cfg, split_by_decay(cfg, params));
    const at::Tensor& p = params[0].second;
    if (std::string(c.type) != "Adagrad")  // Adagrad creates its sums with the optimizer
      EXPECT_FALSE(opt->statistic(p, c.names[0]).defined()) << "a statistic before the first update";
    for (auto& [n, t] : params) t.mutable_grad() = torch::full_like(t, 0.5);
    opt->step();
    for (const auto& name : c.names) {
      at::Tensor s = opt->statistic(p, name);
      ASSERT_TRUE(s.defined()) << name;
      EXPECT_EQ(s.sizes(), p.sizes()) << name;
      EXPECT_GT(s.abs().sum().item<double>(), 0.0) << name;
      s.fill_(7.0f);
      EXPECT_TRUE(torch::equal(opt->statistic(p, name), torch::full_like(p, 7.0f))) << name << " is a copy";
    }
    EXPECT_THROW(opt->statistic(p, "exp_avg_sqq"), InputError);
  }
  OptimizerConfig plain_sgd;
  plain_sgd.type = "SGD";
  EXPECT_TRUE(optimizer_statistics(plain_sgd).empty()) << "SGD without momentum keeps nothing";
  OptimizerConfig ams;
  ams.amsgrad = true;
  EXPECT_EQ(optimizer_statistics(ams), (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
}

TEST(Optimizers, RejectsBadConfig) {
  auto params = initial_params();
  auto expect_input_error = [&](OptimizerConfig cfg, const std::string& mentions) {
    try {
      make_torch_optimizer(cfg, params);
      ADD_FAILURE() << "expected InputError mentioning " << mentions;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(mentions), std::string::npos) << e.what();
    }
  };
  OptimizerConfig cfg;
  cfg.type = "Adam";
  cfg.bias_correction = false;
  expect_input_error(cfg, "bias_correction");
  cfg = OptimizerConfig{};
  cfg.type = "RMSprop";
  expect_input_error(cfg, "RMSprop");
  cfg = OptimizerConfig{};
  cfg.beta2 = 1.0;
  expect_input_error(cfg, "betas[1]");
  cfg = OptimizerConfig{};
  cfg.type = "Lamb";
  cfg.amsgrad = true;
  expect_input_error(cfg, "amsgrad");
  cfg = OptimizerConfig{};
  cfg.type = "SGD";
  cfg.nesterov = true;  // momentum 0
  expect_input_error(cfg, "nesterov");
  cfg = OptimizerConfig{};
  cfg.lr = -1;
  expect_input_error(cfg, "lr");
  params.clear();
  expect_input_error(OptimizerConfig{}, "no parameters");
}

}  // namespace
}  // namespace polytrain
