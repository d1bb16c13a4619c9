// train_t5: T5 span-corruption pre-training on plain text with a SentencePiece model, as a user
// writes it (FlagAI's T5 example): a Trainer subclass whose forward_step feeds input_ids,
// attention_mask and labels to the model. Config, flags, data split, loop and checkpoints are
// the library's; --init_from / --save_hf read and write Hugging Face model directories.
#include <cmath>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/data/sentencepiece_tokenizer.h"
#include "polytrain/data/span_corruption.h"
#include "polytrain/data/text_dataset.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/models/t5.h"
#include "polytrain/trainer/hf_tokenizer_files.h"
#include "polytrain/trainer/trainer.h"

using namespace polytrain;

class T5Trainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& t5 = dynamic_cast<T5ForConditionalGenerationImpl&>(model);
    return t5.forward(batch.at("input_ids"), batch.at("attention_mask"), batch.at("labels"));
  }
};

namespace {

// Prints the first samples of n batches as text: the corrupted input and the targets.
void inspect_batches(const BatchSource& source, const SentencePieceTokenizer& tok, int64_t n, int64_t micro) {
  auto text = [&](const at::Tensor& row) {
    std::vector<int64_t> ids;
    for (int64_t t = 0; t < row.size(0); ++t)
      if (row[t].item<int64_t>() >= 0) ids.push_back(row[t].item<int64_t>());
    return tok.decode(ids);
  };
  for (int64_t b = 0; b < n && (b + 1) * micro <= source.size(); ++b) {
    std::vector<int64_t> idx(static_cast<size_t>(micro));
    for (int64_t i = 0; i < micro; ++i) idx[static_cast<size_t>(i)] = b * micro + i;
    const Batch batch = source.make_batch(idx, 0);
    std::printf("=== batch %lld: input_ids %lld x %lld, labels %lld x %lld ===\ninputs:  %s\ntargets: %s\n",
                static_cast<long long>(b), static_cast<long long>(batch.at("input_ids").size(0)),
                static_cast<long long>(batch.at("input_ids").size(1)),
                static_cast<long long>(batch.at("labels").size(0)), static_cast<long long>(batch.at("labels").size(1)),
                text(batch.at("input_ids")[0]).c_str(), text(batch.at("labels")[0]).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_main([&]() -> int {
    CLI::App app{"train_t5: T5 span-corruption training"};
    ConfigFlags flags;
    add_config_flags(app, flags);
    std::string spm_model, init_from, save_hf;
    SpanCorruptionOptions span;
    int64_t inspect = 0;
    app.add_option("--spm_model", spm_model,
                   "SentencePiece model with T5's ids (default: data.vocab_file when it is set, else "
                   ".cache/assets/spm/corpus.model from scripts/fetch_assets.sh)");
    app.add_option("--noise_density", span.noise_density, "share of tokens masked (T5: 0.15)");
    app.add_option("--mean_noise_span_length", span.mean_noise_span_length, "mean masked span length (T5: 3)");
    app.add_option("--init_from", init_from, "start from this HF T5 directory's weights and config.json");
    app.add_option("--save_hf", save_hf, "after training, write the model and its tokenizer (spiece.model) to this directory in HF layout");
    app.add_option("--inspect_batches", inspect, "print N decoded corrupted batches, then exit")
        ->check(CLI::NonNegativeNumber);
    if (!parse_cli(app, argc, argv)) return 0;
    Config cfg = build_config(flags);
    if (flags.print_config) {
      std::cout << config_to_json(cfg).dump(2) << std::endl;
      return 0;
    }
    warn_ignored_keys(cfg);
    PT_INPUT_CHECK(cfg.model.model_type == "t5", "model.model_type: '", cfg.model.model_type,
                   "': train_t5 trains t5 models");
    PT_INPUT_CHECK(!cfg.data.train_files.empty(), "data.train_files: not set (plain-text files)");
    if (spm_model.empty()) spm_model = cfg.data.vocab_file.empty() ? ".cache/assets/spm/corpus.model" : cfg.data.vocab_file;
    T5Trainer trainer(cfg);  // first: threads, the run's first line, torch's seed
    const auto tok = SentencePieceTokenizer::load(spm_model, SentencePieceTokenizer::kDefaultExtraIds, true);
    T5Config model_cfg = init_from.empty() ? t5_config_from_json(cfg.model.extra, "model")
                                           : t5_config_from_json(read_pretrained_config(init_from),
                                                                 init_from + "/config.json");
    PT_INPUT_CHECK(tok.vocab_size() <= model_cfg.vocab_size, "model.vocab_size ", model_cfg.vocab_size,
                   " is smaller than the vocabulary of ", spm_model, " (", tok.sp_size(), " pieces + ",
                   tok.extra_ids(), " sentinels = ", tok.vocab_size(), ")");
    PT_INPUT_CHECK(model_cfg.pad_token_id == tok.pad_id() && model_cfg.eos_token_id == tok.eos_id(),
                   "model.pad_token_id / eos_token_id (", model_cfg.pad_token_id, ", ", model_cfg.eos_token_id,
                   ") differ from the SentencePiece model's (", tok.pad_id(), ", ", tok.eos_id(), ")");

    // data.max_seq_length is the encoder's input length; T5's arithmetic gives the raw block
    // length that corrupts to it and the target length.
    const SpanLengths lengths = input_and_target_lengths(cfg.data.max_seq_length, span);
    const SpanCorruptor corruptor(span, SpanCorruptionIds{tok.pad_id(), tok.eos_id(), tok.vocab_size(), tok.extra_ids()},
                                  lengths);
    auto dataset = TokenBlockDataset::build(
        cfg.data.train_files, [&tok](const std::string& para) { return tok.encode(para); }, -1, -1,
        lengths.tokens_length);
    auto split = split_train_eval(dataset.size(), cfg.data.eval_fraction, cfg.trainer.seed);
    SpanCorruptionSource train(dataset, split.train, corruptor, cfg.trainer.seed);
    SpanCorruptionSource eval(dataset, split.eval, corruptor, cfg.trainer.seed);
    const bool main_rank = read_dist_env().rank == 0;
    if (main_rank)
      std::printf("data: %lld SentencePiece tokens from %zu file(s) -> %lld blocks of %lld -> inputs %lld, "
                  "targets %lld: %lld train, %lld eval\n",
                  static_cast<long long>(dataset.num_tokens()), cfg.data.train_files.size(),
                  static_cast<long long>(dataset.size()), static_cast<long long>(lengths.tokens_length),
                  static_cast<long long>(lengths.inputs_length), static_cast<long long>(lengths.targets_length),
                  static_cast<long long>(train.size()), static_cast<long long>(eval.size()));
    if (inspect > 0) {
      inspect_batches(train, tok, inspect, cfg.batch.train_micro_batch_size_per_gpu);
      return 0;
    }

    T5ForConditionalGeneration model = init_from.empty()
                                           ? T5ForConditionalGeneration(model_cfg)
                                           : T5ForConditionalGenerationImpl::from_pretrained(init_from);
    auto result = trainer.train(model.ptr(), train, eval.size() > 0 ? &eval : nullptr);
    if (main_rank && !save_hf.empty()) {
      model->save_pretrained(save_hf);
      save_t5_tokenizer(save_hf, spm_model, tok.extra_ids(), cfg.data.max_seq_length);
      std::printf("saved HF model and tokenizer (spiece.model) to %s\n", save_hf.c_str());
    }
    if (main_rank) std::printf("%s\n", result.done_line().c_str());
    return 0;
  });
}
