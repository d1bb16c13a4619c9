// train_albert: ALBERT pre-training (HF AlbertForPreTraining: masked LM + sentence-order
// prediction) on plain text, as a user writes it: a Trainer subclass whose forward_step feeds
// the batch and its order labels to the model, and reports the two losses apart. Config, flags,
// data split, loop and checkpoints are the library's; --init_from / --save_hf read and write
// Hugging Face model directories. Tokenizer: BERT's uncased WordPiece (data.vocab_file).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/data/mlm_collator.h"
#include "polytrain/data/sop_source.h"
#include "polytrain/data/text_dataset.h"
#include "polytrain/data/wordpiece.h"
#include "polytrain/models/albert.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/trainer/hf_tokenizer_files.h"
#include "polytrain/trainer/trainer.h"

using namespace polytrain;

// The Trainer logs the total loss (MLM + SOP); this one also prints the two parts and the SOP
// accuracy of the samples this rank ran: for training every log_interval x
// gradient_accumulation_steps micro-batches, for each evaluation once it is over. The sums stay
// on the device until printed (no host sync per micro-batch).
class AlbertTrainer : public Trainer {
 public:
  AlbertTrainer(Config cfg, bool prints)
      : Trainer(std::move(cfg)),
        prints_(prints),
        every_(std::max<int64_t>(1, cfg_.trainer.log_interval) *
               std::max<int64_t>(1, cfg_.batch.gradient_accumulation_steps)) {}

  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& albert = dynamic_cast<AlbertForMaskedLMImpl&>(model);
    const bool sop = albert.config_.sentence_order_prediction;
    const at::Tensor order = sop ? batch.at("sentence_order_label") : at::Tensor();
    AlbertOutput out = albert.forward(batch.at("input_ids"), batch.at("attention_mask"), batch.at("token_type_ids"),
                                      batch.at("labels"), order);
    if (sop) {
      const bool training = model.is_training();
      if (training) {  // an evaluation is over, or a train interval is full: print before adding
        if (eval_.batches > 0) report(eval_, "sop eval", "eval_");
        if (train_.batches >= every_) report(train_, "sop train", "");
      }
      (training ? train_ : eval_).add(out, order);
    }
    return out;
  }

  /// Prints what is left (the last evaluation, a partial train interval).
  void flush() {
    if (eval_.batches > 0) report(eval_, "sop eval", "eval_");
    if (train_.batches > 0) report(train_, "sop train", "");
  }

 private:
  struct Tally {
    at::Tensor mlm, sop, correct;  // sums over samples (losses are batch means x samples)
    int64_t samples = 0, batches = 0, first_batch = 1;
    void add(const AlbertOutput& out, const at::Tensor& order) {
      const auto n = static_cast<double>(order.size(0));
      const at::Tensor sop_loss = torch::nn::functional::cross_entropy(out.sop_logits.detach().to(torch::kFloat), order)
                                      .to(torch::kDouble);
      const at::Tensor total = out.loss.detach().to(torch::kDouble);
      const at::Tensor right = out.sop_logits.detach().argmax(-1).eq(order).sum().to(torch::kDouble);
      mlm = mlm.defined() ? mlm + (total - sop_loss) * n : (total - sop_loss) * n;
      sop = sop.defined() ? sop + sop_loss * n : sop_loss * n;
      correct = correct.defined() ? correct + right : right;
      samples += order.size(0);
      ++batches;
    }
  };

  void report(Tally& t, const char* what, const char* prefix) {
    if (prints_) {
      const double n = static_cast<double>(t.samples);
      char range[64] = "";
      if (*prefix == '\0' && t.batches == 1)
        std::snprintf(range, sizeof range, " | micro-batch %lld", static_cast<long long>(t.first_batch));
      else if (*prefix == '\0')
        std::snprintf(range, sizeof range, " | micro-batches %lld-%lld", static_cast<long long>(t.first_batch),
                      static_cast<long long>(t.first_batch + t.batches - 1));
      if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r\033[K");  // the progress bar's line
      std::printf("%s%s | %smlm_loss %.4f | %ssop_loss %.4f | %ssop_accuracy %.4f | samples %lld\n", what, range,
                  prefix, t.mlm.item<double>() / n, prefix, t.sop.item<double>() / n, prefix,
                  t.correct.item<double>() / n, static_cast<long long>(t.samples));
      std::fflush(stdout);
    }
    const int64_t next = t.first_batch + t.batches;
    t = Tally{};
    t.first_batch = next;
  }

  bool prints_;
  int64_t every_;
  Tally train_, eval_;
};

namespace {

// Prints the first samples of n batches: the order label, then the tokens with masked ones as
// {input|label}; and the share of swapped samples over all of them.
void inspect_batches(const SopBatchSource& source, const WordPieceTokenizer& tok, int64_t n, int64_t micro) {
  int64_t swapped = 0, total = 0;
  for (int64_t b = 0; b < n && (b + 1) * micro <= source.size(); ++b) {
    std::vector<int64_t> idx(static_cast<size_t>(micro));
    for (int64_t i = 0; i < micro; ++i) idx[static_cast<size_t>(i)] = b * micro + i;
    const Batch batch = source.make_batch(idx, 0);
    const auto ids = batch.at("input_ids"), labels = batch.at("labels"), order = batch.at("sentence_order_label");
    swapped += order.sum().item<int64_t>(), total += order.size(0);
    std::printf("=== batch %lld ===\n", static_cast<long long>(b));
    for (int64_t s = 0; s < std::min<int64_t>(micro, 2); ++s) {
      std::string line;
      for (int64_t t = 0; t < ids.size(1); ++t) {
        const int64_t id = ids[s][t].item<int64_t>(), label = labels[s][t].item<int64_t>();
        const std::string piece = tok.id_to_token(id);
        line += (line.empty() ? "" : " ") + (label == -100 ? piece : "{" + piece + "|" + tok.id_to_token(label) + "}");
      }
      std::printf("sample %lld (sentence_order_label %lld: %s): %s\n", static_cast<long long>(s),
                  static_cast<long long>(order[s].item<int64_t>()), order[s].item<int64_t>() ? "B A" : "A B",
                  line.c_str());
    }
  }
  std::printf("swapped %lld of %lld samples\n", static_cast<long long>(swapped), static_cast<long long>(total));
}

std::vector<std::string> wordpiece_vocab(const WordPieceTokenizer& tok) {
  std::vector<std::string> vocab;
  for (int64_t id = 0; id < tok.vocab_size(); ++id) vocab.push_back(tok.id_to_token(id));
  return vocab;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main([&]() -> int {
    CLI::App app{"train_albert: ALBERT pre-training (masked LM + sentence-order prediction)"};
    ConfigFlags flags;
    add_config_flags(app, flags);
    std::string init_from, save_hf;
    int64_t inspect = 0;
    app.add_option("--init_from", init_from, "start from this HF ALBERT directory's weights and config.json");
    app.add_option("--save_hf", save_hf, "after training, write the model and its tokenizer (vocab.txt) to this directory in HF layout");
    app.add_option("--inspect_batches", inspect, "print N decoded sentence-order batches, then exit")
        ->check(CLI::NonNegativeNumber);
    if (!parse_cli(app, argc, argv)) return 0;
    Config cfg = build_config(flags);
    if (flags.print_config) {
      std::cout << config_to_json(cfg).dump(2) << std::endl;
      return 0;
    }
    warn_ignored_keys(cfg);
    PT_INPUT_CHECK(cfg.model.model_type == "albert", "model.model_type: '", cfg.model.model_type,
                   "': train_albert trains albert models");
    // The model's config: the `model` section (AlbertForPreTraining, i.e. with the SOP head, unless
    // it sets sentence_order_prediction), or config.json of --init_from.
    AlbertConfig model_cfg;
    if (init_from.empty()) {
      model_cfg = albert_config_from_json(cfg.model.extra, "model");
      if (!cfg.model.extra.contains("sentence_order_prediction")) model_cfg.sentence_order_prediction = true;
    } else {
      model_cfg = albert_config_from_json(read_pretrained_config(init_from), init_from + "/config.json");
    }
    PT_INPUT_CHECK(!cfg.data.vocab_file.empty(), "data.vocab_file: not set (a BERT vocab.txt)");
    PT_INPUT_CHECK(!cfg.data.train_files.empty(), "data.train_files: not set (plain-text files)");
    PT_INPUT_CHECK(cfg.data.max_seq_length <= model_cfg.max_position_embeddings, "data.max_seq_length (",
                   cfg.data.max_seq_length, ") exceeds model.max_position_embeddings (",
                   model_cfg.max_position_embeddings, ")");
    PT_INPUT_CHECK(model_cfg.type_vocab_size >= 2, "model.type_vocab_size (", model_cfg.type_vocab_size,
                   ") must be >= 2: the two segments have token types 0 and 1");
    const bool main_rank = read_dist_env().rank == 0;  // other ranks of a launch stay quiet
    AlbertTrainer trainer(cfg, main_rank);  // first: threads, the run's first line, torch's seed
    const auto tok = WordPieceTokenizer::from_vocab_file(cfg.data.vocab_file);
    PT_INPUT_CHECK(tok.vocab_size() <= model_cfg.vocab_size, "model.vocab_size ", model_cfg.vocab_size,
                   " is smaller than the vocabulary in ", cfg.data.vocab_file, " (", tok.vocab_size(), ")");
    PT_INPUT_CHECK(model_cfg.pad_token_id == tok.pad_id(), "model.pad_token_id (", model_cfg.pad_token_id,
                   ") differs from the vocabulary's [PAD] (", tok.pad_id(), ")");

    // Blocks of max_seq_length - 3 text tokens ([CLS] text [SEP] as the dataset packs them): one
    // more [SEP] between the segments makes samples of max_seq_length.
    auto dataset = TokenBlockDataset::build(cfg.data.train_files, tok, cfg.data.max_seq_length - 1);
    auto split = split_train_eval(dataset.size(), cfg.data.eval_fraction, cfg.trainer.seed);
    std::vector<bool> continuation(static_cast<size_t>(tok.vocab_size())), special(continuation.size());
    for (int64_t id = 0; id < tok.vocab_size(); ++id) {
      continuation[static_cast<size_t>(id)] = tok.is_continuation(id);
      special[static_cast<size_t>(id)] = tok.is_special(id);
    }
    const MlmSpecialIds ids{tok.pad_id(), tok.cls_id(), tok.sep_id(), tok.mask_id(), tok.unk_id(), tok.vocab_size()};
    const MlmCollator collator(cfg.data, ids, continuation, special);
    SopOptions sop{cfg.data.max_seq_length, {}};
    for (const char* end : {".", "?", "!"})
      if (const int64_t id = tok.token_to_id(end); id >= 0) sop.sentence_end_ids.push_back(id);
    SopBatchSource train(dataset, split.train, collator, cfg.trainer.seed, sop);
    SopBatchSource eval(dataset, split.eval, collator, cfg.trainer.seed, sop);
    if (main_rank)
      std::printf("data: %lld blocks of [CLS] A [SEP] B [SEP] = %lld tokens from %zu file(s): %lld train, %lld eval; "
                  "%s\n",
                  static_cast<long long>(dataset.size()), static_cast<long long>(cfg.data.max_seq_length),
                  cfg.data.train_files.size(), static_cast<long long>(train.size()),
                  static_cast<long long>(eval.size()),
                  model_cfg.sentence_order_prediction ? "loss = MLM + SOP" : "loss = MLM (no SOP head)");
    if (inspect > 0) {
      inspect_batches(train, tok, inspect, cfg.batch.train_micro_batch_size_per_gpu);
      return 0;
    }

    AlbertForMaskedLM model = init_from.empty() ? AlbertForMaskedLM(model_cfg)
                                                : AlbertForMaskedLMImpl::from_pretrained(init_from);
    auto result = trainer.train(model.ptr(), train, eval.size() > 0 ? &eval : nullptr);
    trainer.flush();
    if (main_rank && !save_hf.empty()) {
      model->save_pretrained(save_hf);
      save_wordpiece_tokenizer(save_hf, wordpiece_vocab(tok), tok.lowercase(), model_cfg.max_position_embeddings);
      std::printf("saved HF model and tokenizer (vocab.txt) to %s\n", save_hf.c_str());
    }
    if (main_rank) std::printf("%s\n", result.done_line().c_str());
    return 0;
  });
}
