// Pipeline plans (models/pipeline_plan.h) of GPT-2, BERT/RoBERTa, ALBERT and T5: running the
// layers in order gives forward()'s loss and gradients (eval, train, dropout replayed from the
// same seed, activation checkpointing), every trainable parameter is listed by some layer, and a
// plan cut in two and run as two stages (the carry detached at the cut, its gradients handed
// back as the pipeline does) gives the same gradients: a carry tensor that loses its gradient
// on the way (T5's position bias) shows up there.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "polytrain/common/error.h"
#include "polytrain/models/albert.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/pipeline_plan.h"
#include "polytrain/models/t5.h"

namespace polytrain {
namespace {

using Grads = std::map<std::string, at::Tensor>;

/// One model with one micro-batch: how forward computes its loss from the inputs.
struct Case {
  std::string name;
  std::shared_ptr<torch::nn::Module> model;
  TensorMap inputs;
  std::function<at::Tensor(const TensorMap&)> forward_loss;

  PipelinePlan plan() const { return dynamic_cast<PipelinePlanned&>(*model).pipeline_plan(); }
  void set_checkpointing(bool on) const {
    dynamic_cast<ActivationCheckpointing&>(*model).set_activation_checkpointing(on);
  }
};

at::Tensor opt(const TensorMap& in, const std::string& name) { return plan_optional(in, name); }

// Padded batch of [b, l] ids in [2, vocab): row 1 right-padded to 2/3 of l, row 2 left-padded by 2.
std::pair<at::Tensor, at::Tensor> padded_ids(int64_t b, int64_t l, int64_t vocab, int64_t pad) {
  auto ids = torch::randint(2, vocab, {b, l});
  auto mask = torch::ones({b, l}, torch::kLong);
  if (b > 1) mask[1].slice(0, 2 * l / 3).fill_(0);
  if (b > 2) mask[2].slice(0, 0, 2).fill_(0);
  ids.masked_fill_(mask == 0, pad);
  return {ids, mask};
}

// MLM labels: about a third of the unpadded tokens, -100 elsewhere.
at::Tensor mlm_labels(const at::Tensor& ids, const at::Tensor& mask) {
  auto pick = (torch::rand(ids.sizes()) < 0.35).logical_and(mask == 1);
  pick.select(1, 0).fill_(true);  // at least one label per row
  return torch::where(pick, ids, torch::full_like(ids, -100));
}

// A BERT-family micro-batch: padded ids, two segments (the second from type_start), MLM labels.
TensorMap mlm_batch(int64_t vocab, int64_t pad, int64_t type_start) {
  auto [ids, mask] = padded_ids(3, 11, vocab, pad);
  auto types = torch::zeros_like(ids);
  types.slice(1, type_start).fill_(1);
  return {{"input_ids", ids}, {"attention_mask", mask}, {"token_type_ids", types}, {"labels", mlm_labels(ids, mask)}};
}

Case gpt2_case(bool tied, bool fused, bool with_mask, double dropout) {
  Gpt2Config c;
  c.vocab_size = 97, c.n_positions = 40, c.n_embd = 32, c.n_layer = 3, c.n_head = 4;
  c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = dropout;
  c.tie_word_embeddings = tied;
  c.fused_lm_loss = fused;
  c.initializer_range = 0.2;
  torch::manual_seed(1);
  auto model = std::make_shared<Gpt2LMHeadModelImpl>(c);
  auto [ids, mask] = padded_ids(3, 13, c.vocab_size, 0);
  TensorMap in{{"input_ids", ids}, {"labels", torch::where(mask == 1, ids, torch::full_like(ids, -100))}};
  if (with_mask) in["attention_mask"] = mask;
  auto fwd = [model](const TensorMap& i) {
    return model->forward(i.at("input_ids"), opt(i, "attention_mask"), i.at("labels")).loss;
  };
  return {std::string("gpt2") + (tied ? "" : "_untied") + (fused ? "_fused" : "") + (with_mask ? "" : "_nomask"),
          model, in, fwd};
}

Case bert_case(const std::string& type, bool sparse, bool fused, double dropout) {
  ModelConfig c;
  c.model_type = type;
  c.vocab_size = 99, c.hidden_size = 32, c.num_hidden_layers = 3, c.num_attention_heads = 4;
  c.intermediate_size = 37, c.max_position_embeddings = 64;
  c.pad_token_id = type == "roberta" ? 1 : 0;
  c.hidden_dropout_prob = c.attention_probs_dropout_prob = dropout;
  c.sparse_prediction = sparse;
  c.fused_lm_loss = fused;
  torch::manual_seed(2);
  auto model = std::make_shared<BertForMaskedLMImpl>(c);
  TensorMap in = mlm_batch(c.vocab_size, c.pad_token_id, 5);
  auto fwd = [model](const TensorMap& i) {
    return model->forward(i.at("input_ids"), i.at("attention_mask"), i.at("token_type_ids"), i.at("labels")).loss;
  };
  return {type + (sparse ? "_sparse" : "") + (fused ? "_fused" : ""), model, in, fwd};
}

Case albert_case(bool sop, bool tied, int64_t inner_group_num, double dropout) {
  AlbertConfig c;
  c.vocab_size = 99, c.embedding_size = 16, c.hidden_size = 32, c.num_hidden_layers = 4, c.num_hidden_groups = 2;
  c.inner_group_num = inner_group_num;
  c.num_attention_heads = 4, c.intermediate_size = 37, c.max_position_embeddings = 64;
  c.sentence_order_prediction = sop;
  c.tie_word_embeddings = tied;
  c.hidden_dropout_prob = c.attention_probs_dropout_prob = c.classifier_dropout_prob = dropout;
  torch::manual_seed(3);
  auto model = std::make_shared<AlbertForMaskedLMImpl>(c);
  TensorMap in = mlm_batch(c.vocab_size, c.pad_token_id, 6);
  if (sop) in["sentence_order_label"] = torch::tensor({0, 1, 1}, torch::kLong);
  auto fwd = [model](const TensorMap& i) {
    return model->forward(i.at("input_ids"), i.at("attention_mask"), i.at("token_type_ids"), i.at("labels"),
                          opt(i, "sentence_order_label"))
        .loss;
  };
  const std::string name = std::string("albert") + (sop ? "_sop" : "") + (tied ? "" : "_untied");
  return {name + "_inner" + std::to_string(inner_group_num), model, in, fwd};
}

Case t5_case(bool v11, double dropout) {
  T5Config c;
  c.vocab_size = 50, c.d_model = 32, c.d_kv = 8, c.d_ff = 48, c.num_layers = 2, c.num_heads = 4;
  c.relative_attention_num_buckets = 8, c.relative_attention_max_distance = 12;
  c.dropout_rate = dropout;
  if (v11) {
    c.feed_forward_proj = "gated-gelu";
    c.tie_word_embeddings = false;
    c.num_decoder_layers = 3;
  }
  torch::manual_seed(4);
  auto model = std::make_shared<T5ForConditionalGenerationImpl>(c);
  auto [ids, mask] = padded_ids(3, 17, c.vocab_size, 0);
  auto labels = torch::randint(2, c.vocab_size, {3, 9});
  labels[1].slice(0, 6).fill_(-100);
  TensorMap in{{"input_ids", ids}, {"attention_mask", mask}, {"labels", labels}};
  auto fwd = [model](const TensorMap& i) {
    return model->forward(i.at("input_ids"), i.at("attention_mask"), i.at("labels")).loss;
  };
  return {v11 ? "t5_v11" : "t5_v10", model, in, fwd};
}

std::vector<Case> all_cases(double dropout) {
  return {gpt2_case(true, false, true, dropout),   gpt2_case(false, true, true, dropout),
          gpt2_case(true, true, false, dropout),   bert_case("bert", true, true, dropout),
          bert_case("bert", false, false, dropout), bert_case("roberta", false, true, dropout),
          albert_case(false, true, 1, dropout),    albert_case(true, false, 2, dropout),
          t5_case(false, dropout),                 t5_case(true, dropout)};
}

// The gradients `loss` gives every parameter (undefined: none reached it).
Grads grads_of(torch::nn::Module& model, const std::function<void()>& backward) {
  model.zero_grad();
  backward();
  Grads g;
  for (const auto& p : model.named_parameters())
    g[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::Tensor();
  return g;
}

// |a - b| <= 1e-6 |b| (as the largest element of b sets the scale; bit-exact passes trivially).
void expect_close(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a - b).abs().max().item<double>(), scale = b.abs().max().item<double>();
  EXPECT_LE(diff, 1e-6 * scale + 1e-12) << what << ": max diff " << diff << " (scale " << scale << ")";
}

void expect_same_grads(const Grads& got, const Grads& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  size_t with_grad = 0;
  for (const auto& [name, g] : want) {
    expect_close(got.at(name), g, what + " " + name);
    with_grad += g.defined();
  }
  EXPECT_EQ(with_grad, want.size()) << what << ": forward's loss leaves parameters without a gradient";
}

enum class Mode { kEval, kTrain, kTrainCheckpointed };

void set_mode(const Case& c, Mode m) {
  m == Mode::kEval ? c.model->eval() : c.model->train();
  c.set_checkpointing(m == Mode::kTrainCheckpointed);
}

const char* mode_name(Mode m) {
  return m == Mode::kEval ? "eval" : m == Mode::kTrain ? "train" : "train+checkpointing";
}

// forward's loss and gradients against the plan's, from the same seed (dropout draws the same masks).
void expect_plan_equals_forward(const Case& c, Mode mode) {
  set_mode(c, mode);
  const std::string what = c.name + " (" + mode_name(mode) + ")";
  at::Tensor want_loss, got_loss;
  const Grads want = grads_of(*c.model, [&] {
    torch::manual_seed(77);
    want_loss = c.forward_loss(c.inputs);
    want_loss.backward();
  });
  const PipelinePlan plan = c.plan();
  const Grads got = grads_of(*c.model, [&] {
    torch::manual_seed(77);
    got_loss = run_pipeline_plan(plan, c.inputs);
    got_loss.backward();
  });
  expect_close(got_loss, want_loss, what + " loss");
  expect_same_grads(got, want, what);
  set_mode(c, Mode::kEval);
}

TEST(PipelinePlan, LossAndGradientsEqualForward) {
  for (const auto& c : all_cases(0.0))
    for (Mode m : {Mode::kEval, Mode::kTrain, Mode::kTrainCheckpointed}) expect_plan_equals_forward(c, m);
}

TEST(PipelinePlan, DropoutDrawsTheSameMasksAsForward) {
  for (const auto& c : all_cases(0.2))
    for (Mode m : {Mode::kTrain, Mode::kTrainCheckpointed}) expect_plan_equals_forward(c, m);
}

// A parameter no layer lists would be on no stage; a prefix that matches nothing is a typo.
TEST(PipelinePlan, LayersListEveryParameter) {
  for (const auto& c : all_cases(0.0)) {
    const PipelinePlan plan = c.plan();
    std::map<std::string, int> listed;
    for (const auto& p : c.model->named_parameters()) listed[p.key()] = 0;
    std::set<std::string> names;
    for (const auto& layer : plan.layers) {
      EXPECT_TRUE(names.insert(layer.name).second) << c.name << ": layer name '" << layer.name << "' twice";
      EXPECT_FALSE(layer.type.empty()) << c.name << " " << layer.name;
      for (const auto& prefix : layer.params) {
        int matched = 0;
        for (auto& [name, count] : listed)
          if (name.rfind(prefix, 0) == 0) ++count, ++matched;
        EXPECT_GT(matched, 0) << c.name << ": layer " << layer.name << " lists '" << prefix
                              << "', no parameter's prefix";
      }
    }
    for (const auto& [name, count] : listed) EXPECT_GT(count, 0) << c.name << ": no layer lists " << name;
  }
}

TEST(PipelinePlan, SharedParametersAreListedByEveryLayerThatReadsThem) {
  auto albert = albert_case(false, true, 1, 0.0);
  const PipelinePlan plan = albert.plan();
  ASSERT_EQ(plan.layers.size(), 6u);  // embeddings, 4 applications of 2 groups, head
  EXPECT_EQ(plan.layers[1].params, std::vector<std::string>{"albert.encoder.albert_layer_groups.0."});
  EXPECT_EQ(plan.layers[2].params, plan.layers[1].params);
  EXPECT_EQ(plan.layers[4].params, std::vector<std::string>{"albert.encoder.albert_layer_groups.1."});
  auto lists = [](const PipeLayer& l, const std::string& p) {
    return std::find(l.params.begin(), l.params.end(), p) != l.params.end();
  };
  EXPECT_TRUE(lists(plan.layers.back(), "albert.embeddings.word_embeddings.weight"));
  EXPECT_TRUE(lists(bert_case("bert", true, true, 0.0).plan().layers.back(), "bert.embeddings.word_embeddings.weight"));
  EXPECT_TRUE(lists(gpt2_case(true, true, true, 0.0).plan().layers.back(), "transformer.wte.weight"));
  const PipelinePlan t5 = t5_case(false, 0.0).plan();
  std::vector<std::string> shared_readers;
  for (const auto& l : t5.layers)
    if (lists(l, "shared.")) shared_readers.push_back(l.name);
  EXPECT_EQ(shared_readers, (std::vector<std::string>{"encoder.embeddings", "decoder.embeddings", "head"}));
}

// Layers [0, k) on one "stage", [k, n) on the next: the carry crosses detached, the floating
// tensors that need a gradient as fresh leaves; the second stage's backward fills their grads,
// which the first stage's outputs then back-propagate (torch::autograd::backward(outputs, grads)).
Grads two_stage_grads(const Case& c, const PipelinePlan& plan, size_t k, at::Tensor* loss_out) {
  return grads_of(*c.model, [&] {
    torch::manual_seed(77);
    TensorMap carry;
    for (size_t i = 0; i < k; ++i) plan.layers[i].run(c.inputs, carry);
    std::vector<at::Tensor> sent, received;
    TensorMap next;
    for (const auto& [name, t] : carry) {
      ASSERT_TRUE(t.defined()) << c.name << ": undefined carry tensor " << name << " after layer " << k;
      if (t.is_floating_point() && t.requires_grad()) {
        sent.push_back(t);
        received.push_back(t.detach().requires_grad_(true));
        next[name] = received.back();
      } else {
        next[name] = t;
      }
    }
    for (size_t i = k; i < plan.layers.size(); ++i) plan.layers[i].run(c.inputs, next);
    EXPECT_EQ(next.size(), 1u) << c.name << ": the last layer leaves more than the loss in the carry";
    *loss_out = next.at("loss");
    loss_out->backward();
    std::vector<at::Tensor> outputs, grads;
    for (size_t i = 0; i < sent.size(); ++i) {
      if (!received[i].grad().defined()) continue;  // carried past the second stage's use: no gradient
      outputs.push_back(sent[i]);
      grads.push_back(received[i].grad());
    }
    if (!outputs.empty()) torch::autograd::backward(outputs, grads);
  });
}

TEST(PipelinePlan, TwoStagesGiveTheOnePieceGradients) {
  for (const auto& c : all_cases(0.0)) {
    for (Mode mode : {Mode::kTrain, Mode::kTrainCheckpointed}) {
      set_mode(c, mode);
      const PipelinePlan plan = c.plan();
      at::Tensor want_loss;
      const Grads want = grads_of(*c.model, [&] {
        torch::manual_seed(77);
        want_loss = run_pipeline_plan(plan, c.inputs);
        want_loss.backward();
      });
      for (size_t k = 1; k < plan.layers.size(); ++k) {
        const std::string what = c.name + " (" + mode_name(mode) + ") cut before " + plan.layers[k].name;
        at::Tensor loss;
        const Grads got = two_stage_grads(c, plan, k, &loss);
        expect_close(loss, want_loss, what + " loss");
        expect_same_grads(got, want, what);
      }
      set_mode(c, Mode::kEval);
    }
  }
}

// The position bias block 0 computes reaches a later stage as a tensor that needs a gradient.
TEST(PipelinePlan, T5PositionBiasTravelsWithItsGradient) {
  const auto c = t5_case(false, 0.0);
  const PipelinePlan plan = c.plan();
  TensorMap carry;
  plan.layers[0].run(c.inputs, carry);
  plan.layers[1].run(c.inputs, carry);
  ASSERT_EQ(plan.layers[1].name, "encoder.block.0");
  ASSERT_TRUE(carry.count("position_bias"));
  EXPECT_TRUE(carry.at("position_bias").requires_grad());
  EXPECT_FALSE(carry.count("encoder_out"));
  for (size_t i = 2; plan.layers[i - 1].name != "decoder.block.0"; ++i) plan.layers[i].run(c.inputs, carry);
  EXPECT_TRUE(carry.count("encoder_out") && carry.count("enc_mask") && carry.count("position_bias"));
  EXPECT_FALSE(carry.count("self_mask"));
}

// The two-stage check catches a carry that loses its gradient: with block 0's position bias
// detached in the carry, relative_attention_bias gets block 0's share of its gradient only.
TEST(PipelinePlan, TwoStagesCatchADetachedCarry) {
  const auto c = t5_case(false, 0.0);
  c.model->train();
  const std::string bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
  PipelinePlan plan = c.plan();
  at::Tensor loss;
  const at::Tensor want = two_stage_grads(c, plan, 2, &loss).at(bias);
  ASSERT_EQ(plan.layers[1].name, "encoder.block.0");
  auto run = plan.layers[1].run;
  plan.layers[1].run = [run](const TensorMap& in, TensorMap& carry) {
    run(in, carry);
    carry["position_bias"] = carry.at("position_bias").detach();
  };
  const at::Tensor got = two_stage_grads(c, plan, 2, &loss).at(bias);
  EXPECT_GT((got - want).abs().max().item<double>(), 1e-3 * want.abs().max().item<double>());
  c.model->eval();
}

TEST(PipelinePlan, MissingInputsAndLossAreClearErrors) {
  auto c = gpt2_case(true, true, true, 0.0);
  TensorMap no_labels = c.inputs;
  no_labels.erase("labels");
  try {
    run_pipeline_plan(c.plan(), no_labels);
    FAIL() << "no error without labels";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'labels'"), std::string::npos) << e.what();
  }
  PipelinePlan truncated = c.plan();
  truncated.layers.pop_back();
  try {
    run_pipeline_plan(truncated, c.inputs);
    FAIL() << "no error without a loss";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("no \"loss\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace polytrain
