// The model families trained end to end by one process and by a grid of ranks (threads over
// Gloo on loopback), for the parallelism contracts (tensor, pipeline, ZeRO): deterministic token
// batches, tiny GPT-2 / BERT / T5 models, a run described by TpRun, and the comparison of two
// runs' losses and final weights.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/models/albert.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/t5.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/gloo_communicator.h"
#include "polytrain/trainer/trainer.h"
#include "helpers/forked_ranks.h"
#include "helpers/free_port.h"
#include "helpers/temp_dir.h"

namespace polytrain::testing {

namespace family_runs_detail {
namespace fs = std::filesystem;
using json = nlohmann::json;

inline std::unique_ptr<Communicator> gloo(int rank, int world, int port) {
  return make_gloo_communicator(rank, world, "127.0.0.1", port, std::chrono::seconds(60));
}

inline void expect_ranks_pass(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r)
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r << " status " << status[r];
}

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

constexpr int64_t kVocab = 101;  // not a multiple of 2 or 4: the vocabulary is padded

// Deterministic token batches per sample index (no global RNG).
class TokenSource : public BatchSource {
 public:
  TokenSource(std::string family, int64_t n) : family_(std::move(family)), n_(n) {}
  int64_t size() const override { return n_; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t) const override {
    std::vector<at::Tensor> ids, labels;
    for (auto i : indices) {
      auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(i));
      // A learnable pattern: a random start, then +1 steps modulo the vocabulary.
      auto start = torch::randint(4, kVocab, {1}, gen, torch::kLong);
      auto seq = (start + torch::arange(16, torch::kLong) * (1 + i % 3)).remainder(kVocab - 4) + 4;
      ids.push_back(seq);
      labels.push_back(torch::randint(4, kVocab, {8}, gen, torch::kLong));
    }
    Batch b;
    auto x = torch::stack(ids);
    b.set("attention_mask", torch::ones_like(x));
    if (family_ == "gpt2") {
      b.set("input_ids", x);
      b.set("labels", x);
    } else if (family_ == "bert" || family_ == "albert") {
      auto masked = torch::zeros_like(x, torch::kBool);
      masked.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, 16, 4)}, true);
      b.set("input_ids", x.masked_fill(masked, 3));
      b.set("token_type_ids", torch::zeros_like(x));
      b.set("labels", x.masked_fill(masked.logical_not(), -100));
      if (family_ == "albert") {
        std::vector<int64_t> order;
        for (auto i : indices) order.push_back(i % 2);
        b.set("sentence_order_label", torch::tensor(order, torch::kLong));
      }
    } else {
      b.set("input_ids", x);
      b.set("labels", torch::stack(labels));
    }
    return b;
  }

 private:
  std::string family_;
  int64_t n_;
};

inline std::shared_ptr<torch::nn::Module> make_model(const std::string& family, double dropout, int64_t layers = 2) {
  if (family == "gpt2") {
    Gpt2Config c;
    c.vocab_size = kVocab, c.n_positions = 32, c.n_embd = 32, c.n_layer = layers, c.n_head = 4;
    c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = dropout;
    return Gpt2LMHeadModel(c).ptr();
  }
  if (family == "bert") {
    ModelConfig c;
    c.model_type = "bert";
    c.vocab_size = kVocab, c.hidden_size = 32, c.num_hidden_layers = layers, c.num_attention_heads = 4;
    c.intermediate_size = 48, c.max_position_embeddings = 32, c.pad_token_id = 0;
    c.hidden_dropout_prob = c.attention_probs_dropout_prob = dropout;
    return BertForMaskedLM(c).ptr();
  }
  if (family == "albert") {  // ALBERT for pre-training: one shared layer group, the SOP head
    AlbertConfig c;
    c.vocab_size = kVocab, c.embedding_size = 16, c.hidden_size = 32, c.num_hidden_layers = layers;
    c.num_attention_heads = 4, c.intermediate_size = 48, c.max_position_embeddings = 32;
    c.hidden_dropout_prob = c.attention_probs_dropout_prob = dropout, c.classifier_dropout_prob = dropout;
    c.sentence_order_prediction = true;
    return AlbertForMaskedLM(c).ptr();
  }
  T5Config c;  // v1.1 style: gated feed-forward, an untied LM head (vocab-parallel on its own)
  c.vocab_size = kVocab, c.d_model = 32, c.d_kv = 8, c.d_ff = 48, c.num_layers = layers, c.num_heads = 4;
  c.relative_attention_num_buckets = 8, c.relative_attention_max_distance = 12;
  c.feed_forward_proj = "gated-gelu", c.tie_word_embeddings = false, c.dropout_rate = dropout;
  return T5ForConditionalGeneration(c).ptr();
}

class FamilyTrainer : public Trainer {
 public:
  FamilyTrainer(Config cfg, std::string family) : Trainer(std::move(cfg)), family_(std::move(family)) {}
  ModelOutput forward_step(const Batch& b, torch::nn::Module& model) override {
    if (family_ == "gpt2")
      return dynamic_cast<Gpt2LMHeadModelImpl&>(model).forward(b.at("input_ids"), b.at("attention_mask"), b.at("labels"));
    if (family_ == "albert")
      return dynamic_cast<AlbertForMaskedLMImpl&>(model).forward(b.at("input_ids"), b.at("attention_mask"),
                                                                 b.at("token_type_ids"), b.at("labels"),
                                                                 b.at("sentence_order_label"));
    if (family_ == "bert")
      return dynamic_cast<BertForMaskedLMImpl&>(model).forward(b.at("input_ids"), b.at("attention_mask"),
                                                               b.at("token_type_ids"), b.at("labels"));
    return dynamic_cast<T5ForConditionalGenerationImpl&>(model).forward(b.at("input_ids"), b.at("attention_mask"),
                                                                       b.at("labels"));
  }

 private:
  std::string family_;
};

struct TpRun {
  int world = 1;
  int tp = 1;  // 0: env_type pytorch
  int64_t steps = 30;
  double dropout = 0.0;
  int64_t save_interval = 0;
  bool resume = false;
  bool amp_o2 = false;  // amp O2 in bf16 (bf16 weights, fp32 master weights)
  int zero = 0;         // zero_optimization.stage over the data-parallel group
  bool offload = false; // zero_optimization.offload_optimizer to the CPU (and offload_param at stage 3)
  bool bf16 = false;    // bf16.enabled (autocast; fp32 weights and optimizer state)
  const char* env = nullptr;  // another env_type than tp's (e.g. deepspeed at tp 0)
  int pp = 1;                 // trainer.pipeline_parallel_size
  int64_t layers = 2;         // transformer layers of the model
  int64_t accumulation = 2;   // gradient_accumulation_steps (micro-batches per step)
  std::string schedule;       // pipeline.schedule ("" = the default)
  int64_t virtual_stages = 1; // pipeline.virtual_stages
  std::string partition;      // pipeline.partition ("" = the default)
  int64_t checkpoint_interval = 0;  // pipeline.activation_checkpoint_interval
};

inline Config run_config(const fs::path& dir, const TpRun& r) {
  json doc = {{"train_batch_size", 8},
              {"gradient_accumulation_steps", r.accumulation},
              {"gradient_clipping", 1.0},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.003}, {"weight_decay", 0.01}}}}},
              {"trainer",
               {{"env_type", r.env ? r.env : r.tp == 0 ? "pytorch" : "deepspeed+mpu"},
                {"model_parallel_size", std::max(1, r.tp)},
                {"max_steps", r.steps},
                {"eval_interval", 0},
                {"log_interval", 100},
                {"save_interval", r.save_interval},
                {"progress_bar", false},
                {"comm_timeout", 60},
                {"seed", 9},
                {"experiments_dir", (dir / "exp").string()},
                {"save_dir", (dir / "ckpt").string()}}}};
  if (r.resume) doc["trainer"]["load_dir"] = (dir / "ckpt").string();
  if (r.amp_o2) doc["amp"] = {{"enabled", true}, {"opt_level", "O2"}, {"dtype", "bfloat16"}};
  if (r.zero > 0 || r.offload)
    doc["zero_optimization"] = {{"stage", r.zero}, {"offload_optimizer", {{"device", r.offload ? "cpu" : "none"}}}};
  // Stage 3 with every parameter partitioned (these models' parameters are all below
  // DeepSpeed's default persistence threshold of 1e5 elements); its offload moves the
  // parameter partitions to the CPU too.
  if (r.zero == 3) doc["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  if (r.zero == 3 && r.offload) doc["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  if (r.bf16) doc["bf16"] = {{"enabled", true}};
  if (r.pp > 1) doc["trainer"]["pipeline_parallel_size"] = r.pp;
  if (!r.schedule.empty()) doc["pipeline"]["schedule"] = r.schedule;
  if (r.virtual_stages > 1) doc["pipeline"]["virtual_stages"] = r.virtual_stages;
  if (!r.partition.empty()) doc["pipeline"]["partition"] = r.partition;
  if (r.checkpoint_interval > 0) doc["pipeline"]["activation_checkpoint_interval"] = r.checkpoint_interval;
  return config_from_json(doc, "test", r.world);
}

// Trains `family` as `r` says (then `edit` changes the config); rank 0 writes its losses
// (losses.json) and the final whole model (model.safetensors) into `dir`.
inline void train(const std::string& family, const fs::path& dir, const TpRun& r,
           const std::function<void(Config&)>& edit = {}) {
  const int port = free_port();
  std::fflush(nullptr);
  auto status = run_ranks(r.world, std::chrono::seconds(300), [&](int rank) {
    Config cfg = run_config(dir, r);
    if (edit) edit(cfg);
    FamilyTrainer trainer(cfg, family);
    if (r.tp > 0 || r.env) trainer.set_backend(make_backend(cfg, gloo(rank, r.world, port)));
    auto model = make_model(family, r.dropout, r.layers);
    TokenSource data(family, 64);
    auto res = trainer.train(model, data);
    if (rank == 0) {
      std::ofstream(dir / "losses.json") << json(res.losses).dump();
      NamedTensors state;
      for (const auto& p : model->named_parameters()) state.emplace_back(p.key(), p.value().detach());
      save_safetensors((dir / "model.safetensors").string(), state, {});
    }
    return 0;
  });
  expect_ranks_pass(status);
}

inline std::vector<double> losses(const fs::path& dir) {
  std::ifstream in(dir / "losses.json");
  json j;
  in >> j;
  return j.get<std::vector<double>>();
}

inline void expect_same_run(const fs::path& a, const fs::path& b, double tol, const std::string& what) {
  const auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), lb.size()) << what;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], tol * std::abs(la[i])) << what << " step " << i + 1;
  EXPECT_LT(la.back(), la.front()) << what << ": the loss went down";
  std::map<std::string, at::Tensor> wb;
  for (auto& [name, t] : load_safetensors((b / "model.safetensors").string())) wb[name] = t;
  for (auto& [name, t] : load_safetensors((a / "model.safetensors").string())) {
    ASSERT_TRUE(wb.count(name)) << what << ": " << name;
    ASSERT_EQ(t.sizes(), wb[name].sizes()) << what << ": " << name;
    const double scale = std::max(1.0, t.abs().max().item<double>());
    if (name.size() > 11 && name.compare(name.size() - 11, 11, "c_attn.bias") == 0) {
      // GPT-2's key bias has an exactly zero gradient (softmax ignores a per-query constant), so
      // its gradient is rounding noise that Adam turns into lr-sized steps: the query and value
      // blocks are held to `tol`, the key block to 1e-4 (measured 2.1e-5 after 30 steps).
      const int64_t h = t.size(0) / 3;
      for (int64_t b : {0, 2}) EXPECT_LE(max_diff(t.narrow(0, b * h, h), wb[name].narrow(0, b * h, h)), tol * scale) << what << ": " << name;
      EXPECT_LE(max_diff(t.narrow(0, h, h), wb[name].narrow(0, h, h)), 1e-4) << what << ": " << name << " (key block)";
      continue;
    }
    // The weights after 30 Adam steps get twice the losses' tolerance: Adam turns rounding-level
    // differences of near-zero gradients into steps of up to lr, and how a GEMM rounds depends on
    // its shape and the kernel (T5's decoder q weight: 1.3e-5 at TP 2 with oneDNN's sgemm on a
    // Zen 5, under 1e-5 with OpenBLAS there and with oneDNN on an AVX-512 Xeon).
    EXPECT_LE(max_diff(t, wb[name]), 2 * tol * scale) << what << ": " << name;
  }
}

// Trains one process and each of `runs`; each follows the one process within 1e-5.
inline void expect_runs_follow_one_process(const std::string& family, const std::string& tag,
                                    const std::vector<std::pair<std::string, TpRun>>& runs) {
  TempDir tmp(tag);
  TpRun one{1, 0};
  one.layers = runs.empty() ? 2 : runs.front().second.layers;
  train(family, tmp.path / "one", one);
  for (size_t i = 0; i < runs.size(); ++i) train(family, tmp.path / std::to_string(i), runs[i].second);
  for (size_t i = 0; i < runs.size(); ++i)
    expect_same_run(tmp.path / "one", tmp.path / std::to_string(i), 1e-5, family + " " + runs[i].first);
}

// Every rank of `r`'s job must fail make_backend or prepare() with an InputError containing
// `expected` (with `one_line`, a message of one line). Family "mlp": a model without any plan.
inline void expect_prepare_error(const TpRun& r, const std::string& family, const std::string& expected,
                                 const std::function<void(Config&)>& edit = {}, bool one_line = false) {
  polytrain::testing::TempDir tmp("prepare_error");
  const int port = free_port();
  std::fflush(nullptr);
  auto status = run_ranks(r.world, std::chrono::seconds(120), [&](int rank) {
    try {
      Config cfg = run_config(tmp.path, r);
      if (edit) edit(cfg);
      auto backend = make_backend(cfg, gloo(rank, r.world, port));
      std::shared_ptr<torch::nn::Module> model;
      if (family == "mlp")
        model = torch::nn::Sequential(torch::nn::Linear(4, 4)).ptr();
      else
        model = make_model(family, 0.0, r.layers);
      backend->prepare(model, cfg);
    } catch (const InputError& e) {
      const std::string msg = e.what();
      if (msg.find(expected) != std::string::npos && (!one_line || msg.find('\n') == std::string::npos)) return 0;
      std::fprintf(stderr, "rank %d: unexpected message: %s\n", rank, msg.c_str());
      return 1;
    }
    std::fprintf(stderr, "rank %d: no error\n", rank);
    return 1;
  });
  expect_ranks_pass(status);
}

}  // namespace family_runs_detail

using family_runs_detail::expect_prepare_error;
using family_runs_detail::expect_ranks_pass;
using family_runs_detail::gloo;
using family_runs_detail::max_diff;
using family_runs_detail::expect_runs_follow_one_process;
using family_runs_detail::expect_same_run;
using family_runs_detail::FamilyTrainer;
using family_runs_detail::kVocab;
using family_runs_detail::losses;
using family_runs_detail::make_model;
using family_runs_detail::run_config;
using family_runs_detail::TokenSource;
using family_runs_detail::TpRun;
using family_runs_detail::train;

}  // namespace polytrain::testing
