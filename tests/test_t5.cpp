// T5 (v1.0: relu, tied; v1.1: gated-gelu, untied, deeper decoder): logits equal the plain-PyTorch
// reference of HF's modeling_t5.py (scripts/hf_ref/t5.py) on padded inputs, HF names, save/load
// round trip, bit-exact checkpointed gradients with dropout, a copy task that learns, and
// InputErrors naming the file and key for bad checkpoints and configs.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "helpers/hf_parity.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/models/t5.h"
#include "polytrain/common/autocast.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

T5Config tiny_v10(double dropout = 0.0) {
  T5Config c;
  c.vocab_size = 50, c.d_model = 32, c.d_kv = 8, c.d_ff = 48, c.num_layers = 2, c.num_heads = 4;
  // 8 buckets, max distance 12: offsets beyond the exact buckets land in the log-spaced ones.
  c.relative_attention_num_buckets = 8, c.relative_attention_max_distance = 12;
  c.dropout_rate = dropout;
  return c;
}

T5Config tiny_v11(double dropout = 0.0) {
  T5Config c = tiny_v10(dropout);
  c.feed_forward_proj = "gated-gelu";
  c.tie_word_embeddings = false;
  c.num_decoder_layers = 3;
  return c;
}

using testing::TempDir;

// Padded batch: row 1 right-padded, row 2 left-padded (T5 allows either: positions are relative).
struct Inputs {
  at::Tensor ids, mask, dec_ids;
};
Inputs make_inputs(int64_t vocab) {
  torch::manual_seed(11);
  Inputs in;
  in.ids = torch::randint(2, vocab, {3, 17});
  in.mask = torch::ones_like(in.ids);
  in.mask[1].slice(0, 12).fill_(0);
  in.mask[2].slice(0, 0, 4).fill_(0);
  in.ids.masked_fill_(in.mask == 0, 0);
  in.dec_ids = torch::randint(2, vocab, {3, 15});
  in.dec_ids.select(1, 0).fill_(0);  // decoder_start_token_id
  return in;
}

at::Tensor logits_of(T5ForConditionalGeneration& m, const Inputs& in) {
  torch::NoGradGuard no_grad;
  m->eval();
  return m->forward(in.ids, in.mask, {}, in.dec_ids).logits;
}

void check_parity(const T5Config& cfg, const char* label) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  torch::manual_seed(3);
  T5ForConditionalGeneration model(cfg);
  TempDir dir;
  model->save_pretrained(dir.str());
  const Inputs in = make_inputs(cfg.vocab_size);
  const at::Tensor ours = logits_of(model, in);
  std::string error;
  const NamedTensors ref = testing::python_reference(
      dir.str(), {{"input_ids", in.ids}, {"attention_mask", in.mask}, {"decoder_input_ids", in.dec_ids}}, &error);
  ASSERT_TRUE(error.empty()) << error;
  at::Tensor theirs;
  for (const auto& [name, t] : ref)
    if (name == "logits") theirs = t;
  ASSERT_TRUE(theirs.defined());
  ASSERT_EQ(ours.sizes(), theirs.sizes());
  const double diff = (ours - theirs).abs().max().item<double>();
  std::printf("[ %s ] max |logits - reference| = %.3g (logits max |x| %.3g)\n", label, diff,
              theirs.abs().max().item<double>());
  EXPECT_LT(diff, 1e-4);
  // Not vacuous: the padding reaches the logits (mask applied in encoder and cross-attention).
  Inputs unmasked = in;
  unmasked.mask = torch::ones_like(in.mask);
  EXPECT_GT((logits_of(model, unmasked) - ours).abs().max().item<double>(), 1e-3);
}

// (ctest starts a process per case, ~2 s each here: related checks share a case.)
TEST(T5, LogitsMatchHfReference) {
  check_parity(tiny_v10(), "t5 v1.0 relu tied");
  check_parity(tiny_v11(), "t5 v1.1 gated-gelu untied");
}

void check_parameter_names() {
  T5Config c = tiny_v11();
  c.num_layers = 1, c.num_decoder_layers = 1;
  T5ForConditionalGeneration model(c);
  std::set<std::string> names;
  for (const auto& p : model->named_parameters()) names.insert(p.key());
  const std::string e = "encoder.block.0.layer.", d = "decoder.block.0.layer.";
  std::set<std::string> expected = {"shared.weight", "lm_head.weight", "encoder.final_layer_norm.weight",
                                    "decoder.final_layer_norm.weight",
                                    e + "0.SelfAttention.relative_attention_bias.weight",
                                    d + "0.SelfAttention.relative_attention_bias.weight"};
  for (const auto& a : {"q", "k", "v", "o"}) {
    expected.insert(e + "0.SelfAttention." + a + ".weight");
    expected.insert(d + "0.SelfAttention." + a + ".weight");
    expected.insert(d + "1.EncDecAttention." + a + ".weight");
  }
  for (const auto& f : {"wi_0", "wi_1", "wo"}) {
    expected.insert(e + "1.DenseReluDense." + f + ".weight");
    expected.insert(d + "2.DenseReluDense." + f + ".weight");
  }
  for (const auto& l : {e + "0", e + "1", d + "0", d + "1", d + "2"}) expected.insert(l + ".layer_norm.weight");
  EXPECT_EQ(names, expected);

  // v1.0: wi instead of wi_0/wi_1, no lm_head (tied to shared.weight), one relative bias per stack.
  T5ForConditionalGeneration v10(tiny_v10());
  names.clear();
  for (const auto& p : v10->named_parameters()) names.insert(p.key());
  EXPECT_EQ(names.count("lm_head.weight"), 0u);
  EXPECT_EQ(names.count("encoder.block.1.layer.1.DenseReluDense.wi.weight"), 1u);
  EXPECT_EQ(names.count("encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"), 0u);
  EXPECT_EQ(v10->parameters().size(), names.size());  // the tied matrix is registered once
}

TEST(T5, LabelsAreShiftedRightAndLossIsMeanCrossEntropy) {
  T5ForConditionalGeneration model(tiny_v11());
  model->eval();
  const Inputs in = make_inputs(50);
  auto labels = torch::randint(2, 50, {3, 6});
  labels[0].slice(0, 4).fill_(-100);
  const auto out = model->forward(in.ids, in.mask, labels);
  // HF _shift_right by hand: start token, labels[:-1], -100 -> pad.
  auto dec = torch::cat({torch::zeros({3, 1}, labels.options()), labels.slice(1, 0, 5)}, 1);
  dec.masked_fill_(dec == -100, 0);
  EXPECT_EQ(dec[0][5].item<int64_t>(), 0);
  const auto ref = model->forward(in.ids, in.mask, {}, dec);
  EXPECT_TRUE(torch::equal(out.logits, ref.logits));
  auto lp = torch::log_softmax(ref.logits, -1);
  double sum = 0;
  int n = 0;
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t t = 0; t < 6; ++t) {
      const int64_t y = labels[b][t].item<int64_t>();
      if (y == -100) continue;
      sum -= lp[b][t][y].item<double>(), ++n;
    }
  EXPECT_EQ(n, 16);
  EXPECT_NEAR(out.loss.item<double>(), sum / n, 1e-5);
}

TEST(T5, HfNamesAndBitExactSaveLoad) {
  check_parameter_names();
  for (const T5Config& cfg : {tiny_v10(), tiny_v11()}) {
    T5ForConditionalGeneration model(cfg);
    TempDir dir;
    model->save_pretrained(dir.str());
    auto loaded = T5ForConditionalGenerationImpl::from_pretrained(dir.str());
    EXPECT_EQ(loaded->config_.tie_word_embeddings, cfg.tie_word_embeddings);
    EXPECT_EQ(loaded->config_.decoder_layers(), cfg.decoder_layers());
    const Inputs in = make_inputs(cfg.vocab_size);
    const auto expected = logits_of(model, in);
    EXPECT_TRUE(torch::equal(logits_of(loaded, in), expected));
    // As HF saves it: no tied copies in the file; the config names the architecture.
    const auto file = load_safetensors((dir.path / "model.safetensors").string());
    for (const auto& [name, t] : file) {
      EXPECT_EQ(name.find("embed_tokens"), std::string::npos) << name;
      if (cfg.tie_word_embeddings) EXPECT_NE(name, "lm_head.weight");
    }
    std::ifstream cj(dir.path / "config.json");
    const auto j = nlohmann::json::parse(cj);
    EXPECT_EQ(j["model_type"], "t5");
    EXPECT_EQ(j["architectures"][0], "T5ForConditionalGeneration");

    // Files with the tied copies (older exports), and with the embedding only under its
    // encoder.embed_tokens name, load to the same model.
    NamedTensors with_copies = file, renamed;
    for (const auto& [name, t] : file) {
      if (name == "shared.weight") {
        with_copies.emplace_back("encoder.embed_tokens.weight", t);
        with_copies.emplace_back("decoder.embed_tokens.weight", t);
        if (cfg.tie_word_embeddings) with_copies.emplace_back("lm_head.weight", t);
        renamed.emplace_back("encoder.embed_tokens.weight", t);
      } else {
        renamed.emplace_back(name, t);
      }
    }
    for (const NamedTensors* variant : {&with_copies, &renamed}) {
      save_safetensors((dir.path / "model.safetensors").string(), *variant);
      auto again = T5ForConditionalGenerationImpl::from_pretrained(dir.str());
      EXPECT_TRUE(torch::equal(logits_of(again, in), expected));
    }
  }
}

struct StepResult {
  double loss;
  std::vector<at::Tensor> grads;
  double rng_after;
  int checkpointed_blocks;  // CheckpointBackward nodes in the graph
};

int count_checkpoint_nodes(const at::Tensor& loss) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  int n = 0;
  while (!todo.empty()) {
    auto* f = todo.back();
    todo.pop_back();
    if (f == nullptr || !seen.insert(f).second) continue;
    n += f->name() == "polytrain::CheckpointBackward";
    for (const auto& e : f->next_edges()) todo.push_back(e.function.get());
  }
  return n;
}

StepResult train_step(const T5Config& cfg, bool checkpoint) {
  torch::manual_seed(5);
  T5ForConditionalGeneration model(cfg);
  model->set_activation_checkpointing(checkpoint);
  model->train();
  const Inputs in = make_inputs(cfg.vocab_size);
  auto labels = torch::randint(2, cfg.vocab_size, {3, 9});
  labels[2].slice(0, 6).fill_(-100);
  auto loss = model->forward(in.ids, in.mask, labels).loss;
  const int blocks = count_checkpoint_nodes(loss);
  loss.backward();
  StepResult r{loss.item<double>(), {}, torch::rand({1}).item<double>(), blocks};
  for (auto& p : model->parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return r;
}

void expect_identical(const StepResult& a, const StepResult& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.rng_after, b.rng_after);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "parameter " << i;
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "parameter " << i;
  }
}

void check_bf16_autocast();

TEST(T5, CheckpointedGradientsBitIdenticalAndBf16Runs) {
  check_bf16_autocast();
  for (const T5Config& cfg : {tiny_v10(0.1), tiny_v11(0.1)}) {
    const StepResult plain = train_step(cfg, false), ckpt = train_step(cfg, true);
    EXPECT_EQ(plain.checkpointed_blocks, 0);
    EXPECT_EQ(ckpt.checkpointed_blocks, cfg.num_layers + cfg.decoder_layers());  // every block
    expect_identical(plain, ckpt);
    // Not vacuous: another dropout rate gives other gradients.
    T5Config other = cfg;
    other.dropout_rate = 0.2;
    EXPECT_FALSE(torch::equal(plain.grads[0], train_step(other, false).grads[0]));
  }
}

// The trainer's bf16 mode: T5LayerNorm's fp32 variance, fp32 softmax and wo in its weights' dtype
// keep the loss near fp32's; checkpointed blocks replay the autocast setting.
void check_bf16_autocast() {
  for (const T5Config& cfg : {tiny_v10(0.1), tiny_v11(0.1)}) {
    torch::manual_seed(2);
    T5ForConditionalGeneration model(cfg);
    model->set_activation_checkpointing(true);
    const Inputs in = make_inputs(cfg.vocab_size);
    const auto labels = torch::randint(2, cfg.vocab_size, {3, 9});
    model->eval();
    const double fp32 = model->forward(in.ids, in.mask, labels).loss.item<double>();
    at::Tensor loss;
    {
      AutocastGuard bf16(c10::kCPU, at::kBFloat16);
      loss = model->forward(in.ids, in.mask, labels).loss;
      EXPECT_NEAR(loss.item<double>(), fp32, 0.05 * fp32);
      model->train();
      loss = model->forward(in.ids, in.mask, labels).loss;
    }
    loss.backward();
    for (const auto& p : model->named_parameters())
      ASSERT_TRUE(p.value().grad().defined() && torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
  }
}

TEST(T5, LearnsACopyTask) {
  torch::manual_seed(1);
  T5Config cfg = tiny_v10(0.0);
  cfg.vocab_size = 24;
  T5ForConditionalGeneration model(cfg);
  model->train();
  auto ids = torch::randint(2, 24, {16, 8});
  ids.select(1, 7).fill_(cfg.eos_token_id);
  const auto mask = torch::ones_like(ids);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = model->forward(ids, mask, ids).loss;
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("[ copy task ] loss %.3f -> %.3f over 30 Adam steps\n", first, last);
  EXPECT_LT(last, 0.5 * first);
}

std::string load_error(const std::string& dir) {
  try {
    T5ForConditionalGenerationImpl::from_pretrained(dir);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(T5, BadCheckpointsAreInputErrorsNamingFileAndKey) {
  T5ForConditionalGeneration model(tiny_v10());
  TempDir dir;
  model->save_pretrained(dir.str());
  const std::string cfg_path = (dir.path / "config.json").string(), st = (dir.path / "model.safetensors").string();
  const auto good_cfg = t5_config_to_json(model->config_);
  const auto good = load_safetensors(st);

  auto j = good_cfg;
  j["num_heads"] = 0;
  std::ofstream(cfg_path) << j.dump();
  std::string err = load_error(dir.str());
  EXPECT_NE(err.find(cfg_path), std::string::npos) << err;
  EXPECT_NE(err.find("'num_heads' must be > 0"), std::string::npos) << err;
  std::ofstream(cfg_path) << good_cfg.dump();

  const std::string q = "encoder.block.1.layer.0.SelfAttention.q.weight";
  NamedTensors wrong = good;
  for (auto& [name, t] : wrong)
    if (name == q) t = torch::zeros({16, 32});
  save_safetensors(st, wrong);
  err = load_error(dir.str());
  EXPECT_NE(err.find(st), std::string::npos) << err;
  EXPECT_NE(err.find(q), std::string::npos) << err;
  EXPECT_NE(err.find("shape"), std::string::npos) << err;

  const std::string ln = "decoder.final_layer_norm.weight";
  NamedTensors missing;
  for (const auto& [name, t] : good)
    if (name != ln) missing.emplace_back(name, t);
  save_safetensors(st, missing);
  err = load_error(dir.str());
  EXPECT_NE(err.find(st), std::string::npos) << err;
  EXPECT_NE(err.find(ln), std::string::npos) << err;

  EXPECT_NE(load_error((dir.path / "nope").string()).find("config.json"), std::string::npos);
  j = good_cfg;
  j["model_type"] = "bert";
  std::ofstream(cfg_path) << j.dump();
  EXPECT_NE(load_error(dir.str()).find("'model_type' is 'bert'"), std::string::npos);
}

void check_polytrain_model_section();

TEST(T5Config, HfKeysAliasesChecksAndPolytrainSection) {
  check_polytrain_model_section();
  // HF's t5-small config.json keys (+ v1.1's), and its aliases.
  const auto c = t5_config_from_json({{"d_model", 512}, {"num_decoder_layers", nullptr}, {"num_layers", 6},
                                      {"feed_forward_proj", "gated-gelu"}, {"tie_word_embeddings", false},
                                      {"task_specific_params", {{"summarization", {{"prefix", "summarize: "}}}}},
                                      {"dense_act_fn", "gelu_new"}, {"is_gated_act", true}},
                                     "config.json");
  EXPECT_EQ(c.decoder_layers(), 6);
  EXPECT_EQ(c.dense_act_fn(), "gelu_new");
  EXPECT_TRUE(c.is_gated_act());
  EXPECT_TRUE(c.extra.contains("task_specific_params"));
  const auto back = t5_config_to_json(c);
  EXPECT_EQ(back["num_decoder_layers"], 6);
  EXPECT_EQ(back["task_specific_params"]["summarization"]["prefix"], "summarize: ");
  const auto again = t5_config_from_json(back, "x");
  EXPECT_EQ(t5_config_to_json(again), back);
  const auto aliased =
      t5_config_from_json({{"hidden_size", 64}, {"num_attention_heads", 2}, {"num_hidden_layers", 3}}, "m");
  EXPECT_EQ(aliased.d_model, 64);
  EXPECT_EQ(aliased.num_heads, 2);
  EXPECT_EQ(aliased.decoder_layers(), 3);

  auto error_of = [](const nlohmann::json& j) {
    try {
      t5_config_from_json(j, "model");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error_of({{"num_heads", 0}}), "model: 'num_heads' must be > 0, got 0");
  EXPECT_NE(error_of({{"feed_forward_proj", "gated-gelu-x"}}).find("'feed_forward_proj'"), std::string::npos);
  EXPECT_NE(error_of({{"feed_forward_proj", "swiglu"}}).find("not supported"), std::string::npos);
  EXPECT_NE(error_of({{"d_model", "512"}}).find("'d_model' must be an integer"), std::string::npos);
  EXPECT_NE(error_of({{"dropout_rate", 1.0}}).find("'dropout_rate'"), std::string::npos);
  EXPECT_NE(error_of({{"pad_token_id", 40000}}).find("'pad_token_id'"), std::string::npos);
  EXPECT_NE(error_of({{"relative_attention_num_buckets", 2}}).find("relative_attention_num_buckets"),
            std::string::npos);
  EXPECT_NE(error_of({{"dense_act_fn", "relu"}, {"feed_forward_proj", "gated-gelu"}}).find("'dense_act_fn'"),
            std::string::npos);
}

void check_polytrain_model_section() {
  const nlohmann::json doc = {{"train_batch_size", 8},
                              {"model", {{"model_type", "t5"}, {"d_model", 48}, {"num_heads", 6}, {"d_kv", 8}}}};
  const Config cfg = config_from_json(doc, "train.json");
  const T5Config c = t5_config_from_json(cfg.model.extra, "model");
  EXPECT_EQ(c.d_model, 48);
  EXPECT_EQ(c.num_heads, 6);
  T5ForConditionalGeneration model(c);
  EXPECT_EQ(model->encoder->block->size(), 6u);
}

}  // namespace
}  // namespace polytrain
