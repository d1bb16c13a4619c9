// BERT / RoBERTa in Hugging Face's layout: logits equal the plain-PyTorch reference of
// transformers' code (scripts/hf_ref/bert.py) on tiny random models with padding, save_pretrained
// -> from_pretrained is bit-exact, bare base-model and HF-extra checkpoints load, and bad
// checkpoints or configs are InputErrors naming the file and the key or tensor.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "helpers/hf_parity.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/checkpoint/safetensors.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny(const std::string& type) {
  ModelConfig c;
  c.model_type = type;
  c.vocab_size = 99;
  c.hidden_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.intermediate_size = 37;
  c.max_position_embeddings = 64;
  c.pad_token_id = type == "roberta" ? 1 : 0;
  return c;
}

// Every weight moved off its initial value (LayerNorms off 1/0, biases off 0), so a wrongly
// named or unused tensor changes the logits.
BertForMaskedLM random_model(const ModelConfig& cfg, uint64_t seed) {
  torch::manual_seed(seed);
  BertForMaskedLM m(cfg);
  torch::NoGradGuard g;
  for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.1);
  m->eval();
  return m;
}

// Three sequences of lengths 11, 7, 4 padded to 11 with pad_token_id; two segments.
NamedTensors padded_inputs(const ModelConfig& cfg) {
  torch::manual_seed(99);
  const int64_t b = 3, l = 11;
  auto ids = torch::randint(2, cfg.vocab_size, {b, l});
  auto mask = torch::ones({b, l}, torch::kLong);
  const int64_t lengths[] = {11, 7, 4};
  for (int64_t i = 0; i < b; ++i) {
    mask[i].slice(0, lengths[i]).fill_(0);
    ids[i].slice(0, lengths[i]).fill_(cfg.pad_token_id);
  }
  auto types = torch::zeros({b, l}, torch::kLong);
  types.slice(1, 5).fill_(1);
  return {{"input_ids", ids}, {"attention_mask", mask}, {"token_type_ids", types}};
}

at::Tensor get(const NamedTensors& t, const std::string& name) {
  for (const auto& [n, v] : t)
    if (n == name) return v;
  return {};
}

at::Tensor logits_of(BertForMaskedLM m, const NamedTensors& in) {
  torch::NoGradGuard g;
  return m->forward(get(in, "input_ids"), get(in, "attention_mask"), get(in, "token_type_ids")).logits;
}

class HfBertTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string sub(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  testing::TempDir tmp_{"pt_hfbert"};
  const std::string dir_ = tmp_.str();
};

TEST_P(HfBertTest, LogitsMatchPythonReference) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  const auto cfg = tiny(GetParam());
  auto model = random_model(cfg, 1);
  model->save_pretrained(sub("m"));
  const auto inputs = padded_inputs(cfg);
  std::string error;
  const auto ref = testing::python_reference(sub("m"), inputs, &error);
  ASSERT_TRUE(error.empty()) << error;
  const auto mine = logits_of(model, inputs), theirs = get(ref, "logits");
  ASSERT_TRUE(theirs.defined());
  ASSERT_EQ(mine.sizes(), theirs.sizes());
  const double diff = (mine - theirs).abs().max().item<double>();
  std::printf("%s max abs logit difference vs reference: %.3g (logit scale %.3g)\n", GetParam().c_str(), diff,
              theirs.abs().max().item<double>());
  EXPECT_LT(diff, 1e-4);
  // Not vacuous: another model's logits are far off.
  EXPECT_GT((logits_of(random_model(cfg, 2), inputs) - theirs).abs().max().item<double>(), 0.1);
}

TEST_P(HfBertTest, SavePretrainedRoundTripIsBitExact) {
  const auto cfg = tiny(GetParam());
  auto model = random_model(cfg, 3);
  model->save_pretrained(sub("m"));
  EXPECT_TRUE(fs::exists(sub("m/config.json")));
  const auto j = read_pretrained_config(sub("m"));
  EXPECT_EQ(j.at("model_type"), GetParam());
  EXPECT_EQ(j.at("architectures")[0], GetParam() == "roberta" ? "RobertaForMaskedLM" : "BertForMaskedLM");
  // HF's safetensors layout: the tied decoder is not written.
  for (const auto& [name, t] : load_safetensors(sub("m/model.safetensors")))
    EXPECT_EQ(name.find("decoder"), std::string::npos) << name;

  auto loaded = BertForMaskedLMImpl::from_pretrained(sub("m"));
  loaded->eval();
  EXPECT_EQ(loaded->config_.num_hidden_layers, cfg.num_hidden_layers);
  EXPECT_EQ(loaded->config_.pad_token_id, cfg.pad_token_id);
  const auto in = padded_inputs(cfg);
  EXPECT_TRUE(torch::equal(logits_of(model, in), logits_of(loaded, in)));
}

// What transformers' BertModel / RobertaModel saves: names without the prefix, plus a pooler.
TEST_P(HfBertTest, BareBaseModelCheckpointLoads) {
  const auto cfg = tiny(GetParam());
  auto model = random_model(cfg, 4);
  model->save_pretrained(sub("full"));
  const std::string prefix = GetParam() + ".";
  NamedTensors base;
  for (const auto& [name, t] : load_safetensors(sub("full/model.safetensors")))
    if (name.rfind(prefix, 0) == 0) base.emplace_back(name.substr(prefix.size()), t);
  base.emplace_back("pooler.dense.weight", torch::randn({32, 32}));
  base.emplace_back("pooler.dense.bias", torch::randn({32}));
  fs::create_directories(sub("base"));
  fs::copy_file(sub("full/config.json"), sub("base/config.json"));
  save_safetensors(sub("base/model.safetensors"), base);

  auto loaded = BertForMaskedLMImpl::from_pretrained(sub("base"));
  loaded->eval();
  const auto in = padded_inputs(cfg);
  torch::NoGradGuard g;
  auto h1 = model->forward(get(in, "input_ids"), get(in, "attention_mask"), get(in, "token_type_ids")).hidden_states;
  auto h2 = loaded->forward(get(in, "input_ids"), get(in, "attention_mask"), get(in, "token_type_ids")).hidden_states;
  EXPECT_TRUE(torch::equal(h1, h2));
}

// Older transformers (pytorch_model.bin converted) files carry the tied decoder, position_ids
// buffers and, from BertForPreTraining, the pooler and NSP head: loaded, those ignored.
TEST_P(HfBertTest, CheckpointWithHfExtrasLoads) {
  const auto cfg = tiny(GetParam());
  auto model = random_model(cfg, 5);
  model->save_pretrained(sub("m"));
  auto tensors = load_safetensors(sub("m/model.safetensors"));
  const bool roberta = GetParam() == "roberta";
  const std::string base = roberta ? "roberta" : "bert", head = roberta ? "lm_head" : "cls.predictions";
  tensors.emplace_back(head + ".decoder.weight", model->lm_head->decoder_weight_.detach().clone());
  tensors.emplace_back(head + ".decoder.bias", model->lm_head->bias.detach().clone());
  tensors.emplace_back(base + ".embeddings.position_ids", torch::arange(64).unsqueeze(0));
  tensors.emplace_back(base + ".pooler.dense.weight", torch::randn({32, 32}));
  if (!roberta) tensors.emplace_back("cls.seq_relationship.weight", torch::randn({2, 32}));
  save_safetensors(sub("m/model.safetensors"), tensors);
  auto loaded = BertForMaskedLMImpl::from_pretrained(sub("m"));
  loaded->eval();
  const auto in = padded_inputs(cfg);
  EXPECT_TRUE(torch::equal(logits_of(model, in), logits_of(loaded, in)));
}

// hidden_act relu: BERT's head transform follows it, RoBERTa's lm_head applies gelu regardless.
TEST_P(HfBertTest, HeadActivationMatchesHfWithReluHiddenAct) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  auto cfg = tiny(GetParam());
  cfg.hidden_act = "relu";
  auto model = random_model(cfg, 3);
  model->save_pretrained(sub("m"));
  const auto inputs = padded_inputs(cfg);
  std::string error;
  const auto ref = testing::python_reference(sub("m"), inputs, &error);
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_LT((logits_of(model, inputs) - get(ref, "logits")).abs().max().item<double>(), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Family, HfBertTest, ::testing::Values("bert", "roberta"),
                         [](const auto& info) { return info.param; });

// ---- bad checkpoints and configs -----------------------------------------------------------------

class HfBertBadInput : public HfBertTest {
 protected:
  void SetUp() override {
    HfBertTest::SetUp();
    fresh();
  }
  // Each case below starts from a good checkpoint (cases share one process: ctest starts one
  // per test, and loading libtorch costs more than the case).
  void fresh() { model_->save_pretrained(sub("m")); }
  BertForMaskedLM model_ = random_model(tiny("bert"), 6);
  void expect_error(const std::vector<std::string>& parts) {
    testing::expect_input_error([&] { BertForMaskedLMImpl::from_pretrained(sub("m")); }, parts);
  }
  void rewrite_tensors(const std::function<void(NamedTensors&)>& edit) { testing::rewrite_safetensors(sub("m"), edit); }
  void rewrite_config(const std::function<void(nlohmann::json&)>& edit) { testing::rewrite_config_json(sub("m"), edit); }
};

TEST_F(HfBertBadInput, CheckpointErrorsNameFileAndTensor) {
  {
    SCOPED_TRACE("WrongShape");
    fresh();
    rewrite_tensors([](NamedTensors& t) {
      for (auto& [n, v] : t)
        if (n == "bert.encoder.layer.1.intermediate.dense.weight") v = torch::zeros({36, 32});
    });
    expect_error({"model.safetensors", "bert.encoder.layer.1.intermediate.dense.weight", "[36, 32]", "[37, 32]"});
  }
  {
    SCOPED_TRACE("MissingTensor");
    fresh();
    rewrite_tensors([](NamedTensors& t) {
      t.erase(std::remove_if(t.begin(), t.end(), [](const auto& p) { return p.first == "cls.predictions.bias"; }),
              t.end());
    });
    expect_error({"model.safetensors", "missing", "cls.predictions.bias"});
  }
  {
    SCOPED_TRACE("UnexpectedTensor");
    fresh();
    rewrite_tensors([](NamedTensors& t) { t.emplace_back("bert.encoder.layer.2.output.dense.weight", torch::zeros({2})); });
    expect_error({"model.safetensors", "bert.encoder.layer.2.output.dense.weight"});
  }
  {
    SCOPED_TRACE("LayerCountDisagreesWithWeights");
    fresh();
    rewrite_config([](nlohmann::json& j) { j["num_hidden_layers"] = 3; });
    expect_error({"model.safetensors", "missing", "bert.encoder.layer.2."});
  }
}

TEST_F(HfBertBadInput, ConfigErrorsNameFileAndKey) {
  {
    SCOPED_TRACE("HeadsDoNotDivideHiddenSize");
    fresh();
    rewrite_config([](nlohmann::json& j) { j["num_attention_heads"] = 5; });
    expect_error({"config.json", "'hidden_size'", "num_attention_heads"});
  }
  {
    SCOPED_TRACE("WrongValueType");
    fresh();
    rewrite_config([](nlohmann::json& j) { j["intermediate_size"] = "37"; });
    expect_error({"config.json", "'intermediate_size'"});
  }
  {
    SCOPED_TRACE("NotABertConfig");
    fresh();
    rewrite_config([](nlohmann::json& j) { j["model_type"] = "albert"; });
    expect_error({"config.json", "model_type", "albert"});
  }
  {
    SCOPED_TRACE("RelativePositionsRefused");
    fresh();
    rewrite_config([](nlohmann::json& j) { j["position_embedding_type"] = "relative_key"; });
    expect_error({"config.json", "position_embedding_type", "relative_key"});
  }
  {
    SCOPED_TRACE("MissingFiles");
    fresh();
    fs::remove(sub("m/model.safetensors"));
    expect_error({"model.safetensors", "not found"});
    fs::remove(sub("m/config.json"));
    expect_error({"config.json"});
  }
}

TEST(HfBertConfig, JsonRoundTripKeepsExtraKeys) {
  auto cfg = tiny("roberta");
  cfg.extra = {{"torch_dtype", "float32"}, {"bos_token_id", 0}};
  const auto j = bert_config_to_json(cfg);
  EXPECT_EQ(j.at("model_type"), "roberta");
  EXPECT_EQ(j.at("torch_dtype"), "float32");
  const auto back = bert_config_from_json(j, "x/config.json");
  EXPECT_EQ(back.hidden_size, 32);
  EXPECT_EQ(back.pad_token_id, 1);
  EXPECT_EQ(back.intermediate_size, 37);
  EXPECT_EQ(back.extra.at("torch_dtype"), "float32");
  EXPECT_EQ(bert_config_to_json(back), j);
}

}  // namespace
}  // namespace polytrain
