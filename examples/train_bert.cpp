// train_bert: BERT (or RoBERTa) masked-LM pre-training on plain text, as a user writes it:
// a Trainer subclass whose forward_step feeds the batch to the model. Everything else
// (config, flags, data, loop, checkpoints) is the library's. --init_from / --save_hf read and
// write Hugging Face model directories (config.json + model.safetensors, and vocab.txt).
#include <cmath>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>

#include "polytrain/common/dist_env.h"
#include "polytrain/common/cli_config.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/mlm_source.h"
#include "polytrain/data/text_dataset.h"
#include "polytrain/data/wordpiece.h"
#include "polytrain/models/bert.h"
#include "polytrain/trainer/hf_tokenizer_files.h"
#include "polytrain/trainer/trainer.h"

using namespace polytrain;

class BertTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& bert = dynamic_cast<BertForMaskedLMImpl&>(model);
    return bert.forward(batch.at("input_ids"), batch.at("attention_mask"), batch.at("token_type_ids"),
                        batch.at("labels"));
  }
};

namespace {

std::vector<std::string> wordpiece_vocab(const WordPieceTokenizer& tok) {
  std::vector<std::string> vocab;
  for (int64_t id = 0; id < tok.vocab_size(); ++id) vocab.push_back(tok.id_to_token(id));
  return vocab;
}

// Prints n decoded masked batches and the mask rate, for a look at the data before training.
void inspect_batches(const BatchSource& source, MlmCollator& collator, const WordPieceTokenizer& tok,
                     int64_t n, int64_t micro) {
  MlmCollator::Stats stats;
  collator.set_stats(&stats);
  for (int64_t b = 0; b < n && (b + 1) * micro <= source.size(); ++b) {
    std::vector<int64_t> idx(micro);
    for (int64_t i = 0; i < micro; ++i) idx[i] = b * micro + i;
    Batch batch = source.make_batch(idx, 0);
    auto ids = batch.at("input_ids"), labels = batch.at("labels");
    std::printf("=== batch %lld ===\n", static_cast<long long>(b));
    for (int64_t s = 0; s < std::min<int64_t>(micro, 2); ++s) {
      std::string line;
      int64_t masked = 0;
      for (int64_t t = 0; t < ids.size(1); ++t) {
        const int64_t id = ids[s][t].item<int64_t>(), label = labels[s][t].item<int64_t>();
        std::string piece = tok.id_to_token(id);
        if (label != -100) {
          ++masked;
          piece = "{" + piece + "|" + tok.id_to_token(label) + "}";
        }
        line += (line.empty() ? "" : " ") + piece;
      }
      std::printf("sample %lld (%lld masked): %s\n", static_cast<long long>(s),
                  static_cast<long long>(masked), line.c_str());
    }
  }
  collator.set_stats(nullptr);
  const double m = static_cast<double>(std::max<int64_t>(stats.masked, 1));
  std::printf("mask rate %.4f of %lld candidate tokens: [MASK] %.3f, random %.3f, kept %.3f\n",
              static_cast<double>(stats.masked) / std::max<int64_t>(stats.candidates, 1),
              static_cast<long long>(stats.candidates), stats.replaced_mask / m, stats.replaced_random / m,
              stats.kept / m);
}

}  // namespace

int main(int argc, char** argv) {
  return run_main([&]() -> int {
    CLI::App app{"train_bert: BERT / RoBERTa masked-LM training"};
    ConfigFlags flags;
    add_config_flags(app, flags);
    int64_t inspect = 0;
    std::string init_from, save_hf;
    app.add_option("--init_from", init_from, "start from this HF BERT / RoBERTa directory's weights and config.json");
    app.add_option("--save_hf", save_hf,
                   "after training, write the model and its tokenizer (vocab.txt) to this directory in HF layout");
    app.add_option("--inspect_batches", inspect, "print N decoded masked batches and the mask rate, then exit")
        ->check(CLI::NonNegativeNumber);
    if (!parse_cli(app, argc, argv)) return 0;
    Config cfg = build_config(flags);
    if (flags.print_config) {
      std::cout << config_to_json(cfg).dump(2) << std::endl;
      return 0;
    }
    warn_ignored_keys(cfg);

    PT_INPUT_CHECK(!cfg.data.vocab_file.empty(), "data.vocab_file: not set (a BERT vocab.txt)");
    PT_INPUT_CHECK(!cfg.data.train_files.empty(), "data.train_files: not set (plain-text files)");
    BertTrainer trainer(cfg);  // first: threads, the run's first line, torch's seed
    auto tok = WordPieceTokenizer::from_vocab_file(cfg.data.vocab_file);
    PT_INPUT_CHECK(tok.vocab_size() <= cfg.model.vocab_size, "model.vocab_size ", cfg.model.vocab_size,
                   " is smaller than the vocabulary in ", cfg.data.vocab_file, " (", tok.vocab_size(), ")");
    auto dataset = TokenBlockDataset::build(cfg.data.train_files, tok, cfg.data.max_seq_length);
    auto split = split_train_eval(dataset.size(), cfg.data.eval_fraction, cfg.trainer.seed);
    std::vector<bool> continuation(tok.vocab_size()), special(tok.vocab_size());
    for (int64_t id = 0; id < tok.vocab_size(); ++id) {
      continuation[id] = tok.is_continuation(id);
      special[id] = tok.is_special(id);
    }
    MlmSpecialIds ids{tok.pad_id(), tok.cls_id(), tok.sep_id(), tok.mask_id(), tok.unk_id(), tok.vocab_size()};
    MlmCollator collator(cfg.data, ids, continuation, special);
    MlmBatchSource train(dataset, split.train, collator, cfg.trainer.seed);
    MlmBatchSource eval(dataset, split.eval, collator, cfg.trainer.seed);
    const bool main_rank = read_dist_env().rank == 0;  // other ranks of a launch stay quiet
    if (main_rank)
      std::printf("data: %lld blocks of %lld tokens from %zu file(s): %lld train, %lld eval\n",
                static_cast<long long>(dataset.size()), static_cast<long long>(cfg.data.max_seq_length),
                cfg.data.train_files.size(), static_cast<long long>(train.size()),
                static_cast<long long>(eval.size()));
    if (inspect > 0) {
      inspect_batches(train, collator, tok, inspect, cfg.batch.train_micro_batch_size_per_gpu);
      return 0;
    }

    BertForMaskedLM model = init_from.empty() ? BertForMaskedLM(cfg.model) : BertForMaskedLMImpl::from_pretrained(init_from);
    auto result = trainer.train(model.ptr(), train, eval.size() > 0 ? &eval : nullptr);
    if (main_rank && !save_hf.empty()) {
      model->save_pretrained(save_hf);
      save_wordpiece_tokenizer(save_hf, wordpiece_vocab(tok), tok.lowercase(), model->config_.max_position_embeddings);
      std::printf("saved HF model and tokenizer (vocab.txt) to %s\n", save_hf.c_str());
    }
    if (main_rank) std::printf("%s\n", result.done_line().c_str());
    return 0;
  });
}
