// Apex-equivalent AMP (DeepSpeed's `amp` block) on CPU in bf16: the block's parsing and Apex's /
// DeepSpeed's rules, then per opt_level the dtypes of weights, activations and optimizer state
// and the loss curve against fp32 on a tiny BERT, and O2's exact resume (its fp32 master weights
// are what the checkpoint holds).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <set>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/albert.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/models/t5.h"
#include "polytrain/parallel/amp.h"
#include "polytrain/parallel/single/single_backend.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/pattern_source.h"
#include "helpers/temp_dir.h"

using namespace polytrain;
namespace fs = std::filesystem;
using nlohmann::json;
using polytrain::testing::PatternSource;
using polytrain::testing::TempDir;
using polytrain::testing::tiny_config;

namespace {

// Records the dtypes the forward produced: the last hidden states, and a matmul against the
// word embeddings run in the same context (autocast or not) as the model's own.
class ProbeTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  c10::ScalarType hidden = c10::ScalarType::Undefined, matmul = c10::ScalarType::Undefined;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& bert = dynamic_cast<BertForMaskedLMImpl&>(model);
    auto out = bert.forward(batch.at("input_ids"), batch.at("attention_mask"), batch.at("token_type_ids"),
                            batch.at("labels"));
    hidden = out.hidden_states.scalar_type();
    matmul = torch::matmul(out.hidden_states.narrow(0, 0, 1), bert.lm_head->decoder_weight_.t()).scalar_type();
    return out;
  }
};

// SingleBackend with its optimizer in view.
class ProbeBackend : public SingleBackend {
 public:
  using SingleBackend::SingleBackend;
  Optimizer& optimizer() { return *optimizer_; }
};

Config amp_test_config(const fs::path& root) {
  Config cfg = tiny_config(root, /*dropout=*/0.0);
  cfg.trainer.max_steps = 120;
  cfg.trainer.log_interval = 40;
  cfg.trainer.eval_interval = 0;
  return cfg;
}

// The amp block as a user writes it, parsed through config_from_json (all its rules apply).
Config with_amp(Config cfg, const json& amp) {
  const Config parsed = config_from_json(json{{"train_batch_size", 8}, {"amp", amp}}, "amp.json", 1);
  cfg.amp = parsed.amp;
  return cfg;
}

struct AmpRun {
  TrainResult result;
  std::vector<std::pair<std::string, at::Tensor>> params;  // the model's, after training
  c10::ScalarType hidden, matmul;
  std::vector<c10::ScalarType> optimizer_state;  // dtypes of every optimizer state tensor
};

AmpRun train(const Config& cfg) {
  PatternSource data(256);
  ProbeTrainer trainer(cfg);
  auto backend = std::make_unique<ProbeBackend>(cfg);
  ProbeBackend* probe = backend.get();
  trainer.set_backend(std::move(backend));
  BertForMaskedLM model(cfg.model);
  AmpRun r;
  r.result = trainer.train(model.ptr(), data);
  for (const auto& p : model->named_parameters()) r.params.emplace_back(p.key(), p.value().detach().clone());
  r.hidden = trainer.hidden, r.matmul = trainer.matmul;
  for (const auto& [key, state] : probe->optimizer().torch_optimizer().state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      r.optimizer_state.push_back(s->exp_avg().scalar_type());
      r.optimizer_state.push_back(s->exp_avg_sq().scalar_type());
    }
  }
  return r;
}

double mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return s / static_cast<double>(to - from);
}

std::string expect_error(const json& doc) {
  try {
    config_from_json(doc, "ds.json", 1);
  } catch (const InputError& e) {
    std::printf("%s\n", e.what());
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << doc.dump();
  return "";
}

}  // namespace

// Apex's level table (apex/amp/frontend.py) and its overrides.
TEST(AmpConfig, LevelsMapToApexProperties) {
  const auto plan = [](const json& amp) {
    return amp_plan(config_from_json(json{{"train_batch_size", 8}, {"amp", amp}}, "x", 1).amp);
  };
  EXPECT_FALSE(plan({{"enabled", false}, {"opt_level", "O2"}}).enabled);
  const AmpPlan o0 = plan({{"enabled", true}, {"opt_level", "O0"}});
  EXPECT_TRUE(o0.enabled && !o0.autocast && !o0.cast_model && !o0.master_weights && o0.loss_scale == 1.0);
  const AmpPlan o1 = plan({{"enabled", true}});  // Apex's default level is O1
  EXPECT_TRUE(o1.autocast && !o1.cast_model && !o1.master_weights && o1.loss_scale == 0.0 && o1.outputs.empty());
  EXPECT_EQ(o1.half, "float16");
  const AmpPlan o2 = plan({{"enabled", true}, {"opt_level", "O2"}, {"dtype", "bfloat16"}});
  EXPECT_TRUE(!o2.autocast && o2.cast_model && o2.keep_norm_fp32 && o2.master_weights && o2.loss_scale == 0.0);
  EXPECT_EQ(o2.half, "bfloat16");
  EXPECT_EQ(o2.outputs, "float32");
  const AmpPlan o3 = plan({{"enabled", true}, {"opt_level", "O3"}, {"cast_model_type", "torch.bfloat16"}});
  EXPECT_TRUE(!o3.autocast && o3.cast_model && !o3.keep_norm_fp32 && !o3.master_weights && o3.loss_scale == 1.0);
  EXPECT_EQ(o3.half, "bfloat16");
  // Overrides, Apex's spellings included.
  const AmpPlan o2x = plan({{"enabled", true}, {"opt_level", "O2"}, {"keep_batchnorm_fp32", "False"},
                            {"master_weights", false}, {"loss_scale", 128}, {"cast_model_outputs", "bfloat16"},
                            {"min_loss_scale", 1}, {"max_loss_scale", 1024}});
  EXPECT_TRUE(o2x.cast_model && !o2x.keep_norm_fp32 && !o2x.master_weights && o2x.loss_scale == 128.0);
  EXPECT_EQ(o2x.outputs, "bfloat16");
  EXPECT_EQ(o2x.max_loss_scale, 1024.0);
  const AmpPlan o3d = plan({{"enabled", true}, {"opt_level", "O3"}, {"loss_scale", "dynamic"}, {"master_weights", true}});
  EXPECT_TRUE(o3d.master_weights && o3d.loss_scale == 0.0);
  EXPECT_FALSE(plan({{"enabled", true}, {"opt_level", "O2"}, {"cast_model_type", false}}).cast_model);
  // The block is written back (checkpoint meta, experiment record) and reads the same.
  const json doc = {{"train_batch_size", 8}, {"amp", {{"enabled", true}, {"opt_level", "O2"}, {"dtype", "bfloat16"}, {"loss_scale", 64}}}};
  const Config c = config_from_json(doc, "x", 1);
  const Config back = config_from_json(config_to_json(c), "back", 1);
  EXPECT_EQ(config_to_json(back)["amp"], config_to_json(c)["amp"]);
  EXPECT_EQ(back.amp.loss_scale, 64.0);
  EXPECT_EQ(back.amp.dtype, "bfloat16");
  EXPECT_TRUE(c.ignored_keys.empty()) << "amp is implemented, not an ignored key";
}

TEST(AmpConfig, ApexAndDeepSpeedRulesAreErrorsNamingTheKey) {
  const auto amp = [](json extra) {
    json a = {{"enabled", true}};
    if (extra.is_object()) a.update(extra);
    return json{{"train_batch_size", 8}, {"amp", a}};
  };
  EXPECT_NE(expect_error(amp({{"opt_level", "O4"}})).find("ds.json: 'amp.opt_level' unexpected optimization level 'O4'"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"opt_level", "01"}})).find("the letter O, not the number zero"), std::string::npos);
  EXPECT_NE(expect_error(amp({{"opt_level", "O1"}, {"cast_model_type", "float16"}})).find("'amp.cast_model_type' O1 inserts casts"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"opt_level", "O2"}, {"patch_torch_functions", true}}))
                .find("'amp.patch_torch_functions' true only with opt_level O1"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"keep_batchnorm_fp32", true}})).find("amp.keep_batchnorm_fp32"), std::string::npos);
  EXPECT_NE(expect_error(amp({{"master_weights", true}})).find("amp.master_weights"), std::string::npos);
  EXPECT_NE(expect_error(amp({{"loss_scale", "auto"}})).find("'amp.loss_scale' must be \"dynamic\" or a number > 0"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"loss_scale", -1}})).find("amp.loss_scale"), std::string::npos);
  EXPECT_NE(expect_error(amp({{"num_losses", 2}})).find("amp.num_losses"), std::string::npos);
  EXPECT_NE(expect_error(amp({{"dtype", "int8"}})).find("'amp.dtype' must be \"float16\" or \"bfloat16\""),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"opt_level", "O2"}, {"dtype", "bfloat16"}, {"cast_model_type", "float16"}}))
                .find("give one half type"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"keep_batchnorm_fp32", "yes"}, {"opt_level", "O2"}})).find("amp.keep_batchnorm_fp32"),
            std::string::npos);
  EXPECT_NE(expect_error(amp({{"opt_levle", "O2"}})).find("opt_level"), std::string::npos);  // a typo, suggested
  // DeepSpeed: amp with fp16 / bf16, and amp with ZeRO, are errors.
  json both = amp({});
  both["bf16"] = {{"enabled", true}};
  EXPECT_NE(expect_error(both).find("cannot enable both amp with (legacy) fp16 or bfloat16 mode"), std::string::npos);
  json zero = amp({});
  zero["zero_optimization"] = {{"stage", 2}};
  EXPECT_NE(expect_error(zero).find("amp and ZeRO are not compatible"), std::string::npos);
  // A disabled block still parses strictly, and conflicts only count when it is on.
  json off = {{"train_batch_size", 8}, {"amp", {{"enabled", false}}}, {"bf16", {{"enabled", true}}}};
  EXPECT_NO_THROW(config_from_json(off, "x", 1));
}

TEST(Amp, Float16OnCpuAndUnsupportedBackendsSayHow) {
  TempDir tmp;
  const Config base = amp_test_config(tmp.path);
  PatternSource data(64);
  const auto error_of = [&](const Config& cfg) -> std::string {
    try {
      ProbeTrainer t(cfg);
      BertForMaskedLM model(cfg.model);
      t.train(model.ptr(), data);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of(with_amp(base, {{"enabled", true}, {"opt_level", "O2"}})).find("on CPU set amp.dtype to \"bfloat16\""),
            std::string::npos);
  Config ds = with_amp(base, {{"enabled", true}, {"dtype", "bfloat16"}});
  ds.trainer.env_type = "deepspeed";
  EXPECT_NE(error_of(ds).find("amp with env_type deepspeed"), std::string::npos);
  EXPECT_FALSE(fs::exists(tmp.path / "experiments")) << "an error before training wrote an experiment folder";
}

// The four levels in bf16 on CPU against fp32, 120 steps each.
TEST(Amp, EachLevelHasApexsDtypesAndFollowsTheFp32Curve) {
  TempDir tmp;
  const Config base = amp_test_config(tmp.path);
  const AmpRun fp32 = train(base);
  const size_t n = fp32.result.losses.size();
  ASSERT_EQ(n, 120u);
  EXPECT_LT(mean(fp32.result.losses, n - 10, n), 0.85 * mean(fp32.result.losses, 0, 10)) << "fp32 does not learn";
  struct Expect {
    const char* level;
    c10::ScalarType weights, norms, matmul, hidden, state;
    double tolerance;  // |mean loss of the last 20 steps / fp32's - 1|
  };
  const auto f = at::kFloat, b = at::kBFloat16;
  for (const Expect& e : {Expect{"O0", f, f, f, f, f, 1e-6}, Expect{"O1", f, f, b, f, f, 0.05},
                          Expect{"O2", b, f, b, b, f, 0.05}, Expect{"O3", b, b, b, b, b, 0.15}}) {
    SCOPED_TRACE(e.level);
    const AmpRun r = train(with_amp(base, {{"enabled", true}, {"opt_level", e.level}, {"dtype", "bfloat16"}}));
    ASSERT_EQ(r.result.losses.size(), n);
    for (const auto& [name, p] : r.params) {
      const bool norm = name.find("LayerNorm") != std::string::npos;
      EXPECT_EQ(p.scalar_type(), norm ? e.norms : e.weights) << name;
    }
    EXPECT_EQ(r.matmul, e.matmul);
    EXPECT_EQ(r.hidden, e.hidden);
    ASSERT_FALSE(r.optimizer_state.empty());
    for (auto t : r.optimizer_state) EXPECT_EQ(t, e.state);
    const double last = mean(r.result.losses, n - 20, n), ref = mean(fp32.result.losses, n - 20, n);
    double max_step = 0;
    for (size_t i = 0; i < n; ++i) max_step = std::max(max_step, std::abs(r.result.losses[i] - fp32.result.losses[i]));
    std::printf("%s: loss (last 20) %.4f vs fp32 %.4f (%.2f%%), max per-step |diff| %.4f, first %.4f vs %.4f\n",
                e.level, last, ref, 100 * (last / ref - 1), max_step, r.result.losses[0], fp32.result.losses[0]);
    EXPECT_LT(std::abs(last / ref - 1), e.tolerance);
    EXPECT_LT(last, 0.85 * mean(r.result.losses, 0, 10)) << "does not learn";
    if (std::string(e.level) == "O0") {
      EXPECT_EQ(r.result.losses, fp32.result.losses) << "O0 is fp32";
    } else {
      EXPECT_NE(r.result.losses, fp32.result.losses) << e.level << " gave the fp32 losses bit for bit";
    }
  }
}

// The O2 / O3 cast on every family, without autocast: bf16 weights (normalization layers fp32
// when kept), a forward and backward with padded batches that gives the fp32 loss to bf16
// accuracy, and every gradient in its weight's dtype.
TEST(Amp, EveryFamilyTrainsCastToBf16WithAndWithoutFp32Norms) {
  torch::manual_seed(5);
  auto ids = torch::randint(5, 60, {3, 17});
  auto mask = torch::ones_like(ids);
  mask[1].narrow(0, 12, 5).fill_(0);  // right padding
  mask[2].narrow(0, 0, 4).fill_(0);   // left padding
  auto labels = torch::full_like(ids, -100);
  for (int64_t t = 4; t < 17; t += 3) labels.select(1, t).copy_(ids.select(1, t));
  const auto check = [&](const char* family, torch::nn::Module& model, const std::function<at::Tensor()>& loss_of) {
    for (bool keep : {true, false}) {
      SCOPED_TRACE(std::string(family) + (keep ? " O2 (norms fp32)" : " O3"));
      const auto state = model.named_parameters();
      std::vector<at::Tensor> fp32;
      for (const auto& p : state) fp32.push_back(p.value().detach().clone());
      const double ref = loss_of().item<double>();
      std::set<const void*> norms;
      for (const auto& m : model.modules())
        if (is_norm_module(*m))
          for (const auto& p : m->parameters()) norms.insert(p.unsafeGetTensorImpl());
      ASSERT_FALSE(norms.empty());
      cast_model_for_amp(model, at::kBFloat16, keep);
      const at::Tensor loss = loss_of();
      loss.backward();
      EXPECT_TRUE(std::isfinite(loss.item<double>()));
      EXPECT_NEAR(loss.item<double>(), ref, 0.03 * ref) << "bf16 forward far from fp32";
      int64_t grads = 0;
      for (const auto& p : model.named_parameters()) {
        const bool norm = norms.count(p.value().unsafeGetTensorImpl()) > 0;
        EXPECT_EQ(p.value().scalar_type(), norm && keep ? at::kFloat : at::kBFloat16) << p.key();
        if (!p.value().grad().defined()) continue;
        ++grads;
        EXPECT_EQ(p.value().grad().scalar_type(), p.value().scalar_type()) << p.key();
        EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
      }
      EXPECT_GT(grads, 0);
      torch::NoGradGuard no_grad;  // back to fp32 for the next round
      size_t i = 0;
      for (auto& p : model.named_parameters()) {
        p.value().set_data(fp32[i++]);
        p.value().mutable_grad() = at::Tensor();
      }
      for (auto& b : model.named_buffers())
        if (b.value().is_floating_point()) b.value().set_data(b.value().to(at::kFloat));
    }
  };
  ModelConfig bc;
  bc.vocab_size = 64, bc.hidden_size = 32, bc.num_hidden_layers = 2, bc.num_attention_heads = 2;
  bc.intermediate_size = 48, bc.max_position_embeddings = 32, bc.hidden_dropout_prob = 0.0;
  bc.attention_probs_dropout_prob = 0.0;
  BertForMaskedLM bert(bc);
  check("BERT", *bert, [&] { return bert->forward(ids, mask, torch::zeros_like(ids), labels).loss; });
  AlbertConfig ac;
  ac.vocab_size = 64, ac.embedding_size = 16, ac.hidden_size = 32, ac.num_hidden_layers = 2;
  ac.num_attention_heads = 2, ac.intermediate_size = 48, ac.max_position_embeddings = 32;
  ac.hidden_dropout_prob = ac.attention_probs_dropout_prob = 0.0;
  AlbertForMaskedLM albert(ac);
  check("ALBERT", *albert, [&] { return albert->forward(ids, mask, torch::zeros_like(ids), labels).loss; });
  Gpt2Config gc;
  gc.vocab_size = 64, gc.n_positions = 32, gc.n_embd = 32, gc.n_layer = 2, gc.n_head = 2;
  gc.resid_pdrop = gc.embd_pdrop = gc.attn_pdrop = 0.0;
  Gpt2LMHeadModel gpt2(gc);
  check("GPT-2", *gpt2, [&] { return gpt2->forward(ids, mask, ids).loss; });
  T5Config tc;
  tc.vocab_size = 64, tc.d_model = 32, tc.d_kv = 8, tc.d_ff = 48, tc.num_layers = 2, tc.num_heads = 4;
  tc.dropout_rate = 0.0;
  T5ForConditionalGeneration t5(tc);
  check("T5", *t5, [&] { return t5->forward(ids, mask, ids).loss; });
}

// O2's checkpoint holds the fp32 master weights (not the bf16 model's rounding of them): an
// interrupted run resumes exactly where the uninterrupted one was.
TEST(Amp, O2CheckpointHoldsTheMastersAndResumesExactly) {
  TempDir tmp;
  Config cfg = with_amp(amp_test_config(tmp.path), {{"enabled", true}, {"opt_level", "O2"}, {"dtype", "bfloat16"}});
  cfg.trainer.max_steps = 12;
  cfg.trainer.save_interval = 6;
  cfg.trainer.save_safetensors = true;
  const AmpRun whole = train(cfg);
  Config first = cfg;
  first.trainer.max_steps = 6;
  first.trainer.save_dir = (tmp.path / "ckpt").string();
  const AmpRun a = train(first);
  Config rest = cfg;
  rest.trainer.load_dir = first.trainer.save_dir;
  rest.trainer.save_dir = first.trainer.save_dir;
  const AmpRun b = train(rest);
  ASSERT_EQ(b.result.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(b.result.losses[i], whole.result.losses[6 + i]) << i;
  ASSERT_EQ(b.params.size(), whole.params.size());
  for (size_t i = 0; i < b.params.size(); ++i) EXPECT_TRUE(torch::equal(b.params[i].second, whole.params[i].second)) << b.params[i].first;
  // The consolidated model is fp32 (the masters), finer than the bf16 weights.
  const NamedTensors saved = load_safetensors((fs::path(first.trainer.save_dir) / "global_step6" / "model.safetensors").string());
  bool finer = false;
  for (const auto& [name, t] : saved) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    if (name.find("query.weight") != std::string::npos) finer |= !torch::equal(t, t.to(at::kBFloat16).to(at::kFloat));
  }
  EXPECT_TRUE(finer) << "the saved weights are bf16 values: the masters were not saved";
}
