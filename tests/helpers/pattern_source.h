// Test helper: a tiny BERT config and a synthetic, learnable MLM source for Trainer tests
// (test_trainer.cpp, test_amp.cpp).
#pragma once

#include <filesystem>
#include <vector>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/data/batch_source.h"

namespace polytrain::testing {

constexpr int64_t kVocab = 64, kLen = 16, kMask = 3;

// Sample i: runs of equal tokens, so a masked token is predictable from its neighbours;
// a quarter of the positions masked, keyed on (i, epoch).
class PatternSource : public BatchSource {
 public:
  explicit PatternSource(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override {
    const int64_t b = static_cast<int64_t>(indices.size());
    auto ids = torch::empty({b, kLen}, torch::kLong), labels = torch::full({b, kLen}, -100, torch::kLong);
    for (int64_t r = 0; r < b; ++r) {
      const int64_t i = indices[r];
      for (int64_t t = 0; t < kLen; ++t) {
        // Runs of 4 equal tokens; exactly one of each run masked (so every micro-batch has the
        // same number of labels and the mean of micro-batch means equals the batch mean).
        const int64_t tok = 5 + (i + t / 4) % (kVocab - 5);
        const bool masked = t % 4 == (i + epoch + t / 4) % 4;
        ids[r][t] = masked ? kMask : tok;
        if (masked) labels[r][t] = tok;
      }
    }
    Batch batch;
    batch.set("input_ids", ids);
    batch.set("attention_mask", torch::ones({b, kLen}, torch::kLong));
    batch.set("token_type_ids", torch::zeros({b, kLen}, torch::kLong));
    batch.set("labels", labels);
    return batch;
  }

 private:
  int64_t n_;
};

inline Config tiny_config(const std::filesystem::path& root, double dropout = 0.1) {
  Config cfg;
  cfg.batch = {8, 8, 1, 1};
  cfg.optimizer.type = "AdamW";
  cfg.optimizer.lr = 3e-3;
  cfg.optimizer.weight_decay = 0.01;
  cfg.gradient_clipping = 1.0;
  cfg.model.vocab_size = kVocab;
  cfg.model.hidden_size = 32;
  cfg.model.num_hidden_layers = 2;
  cfg.model.num_attention_heads = 2;
  cfg.model.intermediate_size = 64;
  cfg.model.max_position_embeddings = 32;
  cfg.model.hidden_dropout_prob = dropout;
  cfg.model.attention_probs_dropout_prob = dropout;
  cfg.data.eval_batches = 2;
  cfg.trainer.max_steps = 10;
  cfg.trainer.log_interval = 5;
  cfg.trainer.eval_interval = 5;
  cfg.trainer.save_interval = 0;
  cfg.trainer.experiments_dir = (root / "experiments").string();
  cfg.trainer.progress_bar = false;
  cfg.trainer.seed = 42;
  cfg.trainer.num_threads = 1;
  return cfg;
}

}  // namespace polytrain::testing
