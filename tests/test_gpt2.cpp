// GPT-2: logits equal the plain-PyTorch reference of HF's GPT2LMHeadModel (scripts/hf_ref/gpt2.py)
// within 1e-4; HF-layout save/load round trip is bit-exact; bare GPT2Model checkpoints and old
// checkpoints with attn.bias buffers load; HF's shifted loss; checkpointed blocks give identical
// gradients; a tiny model learns; bad configs and checkpoints are one-line InputErrors.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "polytrain/common/error.h"
#include "helpers/hf_parity.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/hf_pretrained.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

Gpt2Config tiny(bool tied = true, double dropout = 0.0) {
  Gpt2Config c;
  c.vocab_size = 97;
  c.n_positions = 40;
  c.n_embd = 32;
  c.n_layer = 3;
  c.n_head = 4;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = dropout;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.2;  // larger than GPT-2's so attention patterns are far from uniform
  return c;
}

// Right padding in row 1, left padding in row 2 (a fully masked query row there).
std::pair<at::Tensor, at::Tensor> inputs() {
  torch::manual_seed(3);
  auto ids = torch::randint(0, 97, {3, 17});
  auto mask = torch::ones_like(ids);
  mask[1].narrow(0, 12, 5).fill_(0);
  mask[2].narrow(0, 0, 4).fill_(0);
  return {ids, mask};
}

at::Tensor logits(Gpt2LMHeadModel& m, const at::Tensor& ids, const at::Tensor& mask) {
  torch::NoGradGuard g;
  m->eval();
  return m->forward(ids, mask).logits;
}

void expect_parity(bool tied) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  TempDir dir;
  torch::manual_seed(1);
  Gpt2LMHeadModel model(tiny(tied));
  model->save_pretrained(dir.str("m"));
  auto [ids, mask] = inputs();
  auto ours = logits(model, ids, mask);
  std::string error;
  auto ref = testing::python_reference(dir.str("m"), {{"input_ids", ids}, {"attention_mask", mask}}, &error);
  ASSERT_TRUE(error.empty()) << error;
  ASSERT_EQ(ref.size(), 1u);
  ASSERT_EQ(ref[0].first, "logits");
  ASSERT_EQ(ref[0].second.sizes(), ours.sizes());
  const double diff = (ref[0].second - ours).abs().max().item<double>();
  std::printf("GPT-2 (%s) max |logit - reference| = %.3g (logit scale %.3g)\n", tied ? "tied" : "untied",
              diff, ours.abs().max().item<double>());
  EXPECT_LT(diff, 1e-4);
}

TEST(Gpt2, LogitsMatchThePyTorchReference) { expect_parity(true); }
TEST(Gpt2, UntiedHeadLogitsMatchThePyTorchReference) { expect_parity(false); }

TEST(Gpt2, SavePretrainedLoadsBackBitExact) {
  TempDir dir;
  torch::manual_seed(2);
  Gpt2LMHeadModel model(tiny(false));
  model->save_pretrained(dir.str("m"));
  ASSERT_TRUE(fs::exists(dir.str("m/config.json")));
  auto config = read_pretrained_config(dir.str("m"));
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_embd"], 32);
  EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
  auto names = load_safetensors(dir.str("m/model.safetensors"));
  EXPECT_EQ(names.size(), 2u + 3u * 12u + 2u + 1u);  // wte wpe, 12 per block, ln_f, lm_head
  Gpt2LMHeadModel back(Gpt2LMHeadModelImpl::from_pretrained(dir.str("m")));
  auto [ids, mask] = inputs();
  EXPECT_TRUE(torch::equal(logits(model, ids, mask), logits(back, ids, mask)));
}

TEST(Gpt2, BareGpt2ModelCheckpointWithMaskBuffersLoads) {
  // OpenAI's gpt2 on the Hub: names without "transformer.", plus h.N.attn.bias causal masks.
  TempDir dir;
  torch::manual_seed(4);
  Gpt2LMHeadModel model(tiny());
  NamedTensors tensors;
  for (auto& p : model->named_parameters()) tensors.emplace_back(p.key().substr(std::string("transformer.").size()), p.value());
  for (int i = 0; i < 3; ++i)
    tensors.emplace_back("h." + std::to_string(i) + ".attn.bias", torch::ones({1, 1, 40, 40}).tril());
  fs::create_directories(dir.str("m"));
  save_safetensors(dir.str("m/model.safetensors"), tensors);
  std::ofstream(dir.str("m/config.json")) << gpt2_config_to_json(model->config_).dump();
  Gpt2LMHeadModel back(Gpt2LMHeadModelImpl::from_pretrained(dir.str("m")));
  auto [ids, mask] = inputs();
  EXPECT_TRUE(torch::equal(logits(model, ids, mask), logits(back, ids, mask)));
}

TEST(Gpt2, LossIsHfShiftedCrossEntropyFusedOrNot) {
  torch::manual_seed(5);
  auto cfg = tiny();
  Gpt2LMHeadModel model(cfg);
  model->eval();
  auto [ids, mask] = inputs();
  auto labels = ids.masked_fill(mask.eq(0), -100);
  torch::NoGradGuard g;
  auto fused = model->forward(ids, mask, labels).loss.item<double>();
  auto l = model->forward(ids, mask).logits;
  auto expected = torch::nn::functional::cross_entropy(
                      l.narrow(1, 0, 16).reshape({-1, 97}), labels.narrow(1, 1, 16).reshape({-1}),
                      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100))
                      .item<double>();
  EXPECT_NEAR(fused, expected, 1e-5);
  model->config_.fused_lm_loss = false;
  auto plain = model->forward(ids, mask, labels);
  EXPECT_NEAR(plain.loss.item<double>(), expected, 1e-6);
  EXPECT_TRUE(plain.logits.defined());
}

std::vector<at::Tensor> grads(bool checkpoint) {
  torch::manual_seed(6);
  Gpt2LMHeadModel model(tiny(true, 0.1));
  model->set_activation_checkpointing(checkpoint);
  model->train();
  auto [ids, mask] = inputs();
  torch::manual_seed(8);
  model->forward(ids, mask, ids).loss.backward();
  std::vector<at::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST(Gpt2, CheckpointedBlocksGiveBitIdenticalGradients) {
  auto plain = grads(false), ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << "parameter " << i;
}

TEST(Gpt2, TinyModelLearnsARepeatingSequence) {
  torch::manual_seed(9);
  auto cfg = tiny();
  cfg.initializer_range = 0.02;
  Gpt2LMHeadModel model(cfg);
  model->train();
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  auto ids = (torch::arange(32) % 7 + 10).repeat({4, 1});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    auto loss = model->forward(ids, {}, ids).loss;
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("loss %.3f -> %.3f\n", first, last);
  EXPECT_GT(first, 4.0);  // ~ln(97) at init
  EXPECT_LT(last, 0.5);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "no InputError";
}

TEST(Gpt2, BadConfigsAndCheckpointsAreOneLineErrors) {
  EXPECT_EQ(error_of([] { gpt2_config_from_json({{"n_embd", 30}, {"n_head", 4}}, "c.json"); }),
            "c.json: 'n_embd' (30) must be divisible by n_head (4)");
  EXPECT_EQ(error_of([] { gpt2_config_from_json({{"n_layer", "two"}}, "c.json"); }),
            "c.json: 'n_layer' must be an integer, got \"two\"");
  EXPECT_EQ(error_of([] { gpt2_config_from_json({{"num_hidden_layers", 0}}, "c.json"); }),
            "c.json: 'num_hidden_layers' must be > 0, got 0");
  EXPECT_NE(error_of([] { gpt2_config_from_json({{"activation_function", "gelu_x"}}, "c.json"); })
                .find("unsupported activation 'gelu_x'"),
            std::string::npos);

  TempDir dir;
  EXPECT_NE(error_of([&] { Gpt2LMHeadModelImpl::from_pretrained(dir.str("none")); }).find("config.json: cannot read"),
            std::string::npos);
  torch::manual_seed(1);
  Gpt2LMHeadModel model(tiny());
  model->save_pretrained(dir.str("m"));
  // config.json that disagrees with the weights
  auto cfg = tiny();
  cfg.n_embd = 48;
  std::ofstream(dir.str("m/config.json")) << gpt2_config_to_json(cfg).dump();
  const std::string e = error_of([&] { Gpt2LMHeadModelImpl::from_pretrained(dir.str("m")); });
  EXPECT_NE(e.find("model.safetensors: shape mismatch"), std::string::npos) << e;
  EXPECT_NE(e.find("is [96], the model's is [144] and 39 more"), std::string::npos) << e;
  // a missing tensor
  std::ofstream(dir.str("m/config.json")) << gpt2_config_to_json(tiny()).dump();
  auto tensors = load_safetensors(dir.str("m/model.safetensors"));
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [](auto& t) { return t.first == "transformer.ln_f.bias"; }),
                tensors.end());
  save_safetensors(dir.str("m/model.safetensors"), tensors);
  EXPECT_NE(error_of([&] { Gpt2LMHeadModelImpl::from_pretrained(dir.str("m")); })
                .find("missing 1 tensor(s) the model needs: 'transformer.ln_f.bias'"),
            std::string::npos);
}

}  // namespace
}  // namespace polytrain
