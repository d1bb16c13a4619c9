// train_gpt2: GPT-2 causal-LM training on plain text with GPT-2's byte-level BPE, as a user
// writes it: a Trainer subclass whose forward_step feeds the batch to the model. Config, flags,
// data split, loop, checkpoints are the library's. --init_from / --save_hf read and write
// Hugging Face model directories (config.json + model.safetensors).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/data/causal_lm_source.h"
#include "polytrain/data/gpt2_bpe.h"
#include "polytrain/data/text_dataset.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/hf_pretrained.h"
#include "polytrain/trainer/hf_tokenizer_files.h"
#include "polytrain/trainer/trainer.h"

using namespace polytrain;

class Gpt2Trainer : public Trainer {
 public:
  using Trainer::Trainer;
  ModelOutput forward_step(const Batch& batch, torch::nn::Module& model) override {
    auto& gpt2 = dynamic_cast<Gpt2LMHeadModelImpl&>(model);
    const at::Tensor mask = batch.has("attention_mask") ? batch.at("attention_mask") : at::Tensor();
    return gpt2.forward(batch.at("input_ids"), mask, batch.at("labels"));
  }
};

int main(int argc, char** argv) {
  return run_main([&]() -> int {
    CLI::App app{"train_gpt2: GPT-2 causal-LM training"};
    ConfigFlags flags;
    add_config_flags(app, flags);
    std::string merges, init_from, save_hf;
    app.add_option("--merges", merges, "GPT-2 vocab.bpe (default: vocab.bpe beside data.vocab_file)");
    app.add_option("--init_from", init_from, "start from this HF GPT-2 directory's weights and config.json");
    app.add_option("--save_hf", save_hf, "after training, write the model and its tokenizer (vocab.json + merges.txt) to this directory in HF layout");
    if (!parse_cli(app, argc, argv)) return 0;
    Config cfg = build_config(flags);
    if (flags.print_config) {
      std::cout << config_to_json(cfg).dump(2) << std::endl;
      return 0;
    }
    warn_ignored_keys(cfg);
    PT_INPUT_CHECK(cfg.model.model_type == "gpt2", "model.model_type: '", cfg.model.model_type,
                   "': train_gpt2 trains gpt2 models");
    // The model's config: the `model` section, or config.json of --init_from.
    Gpt2Config model_cfg = init_from.empty() ? gpt2_config_from_json(cfg.model.extra, "model")
                                             : gpt2_config_from_json(read_pretrained_config(init_from),
                                                                     init_from + "/config.json");
    PT_INPUT_CHECK(!cfg.data.vocab_file.empty(), "data.vocab_file: not set (GPT-2's encoder.json)");
    PT_INPUT_CHECK(!cfg.data.train_files.empty(), "data.train_files: not set (plain-text files)");
    Gpt2Trainer trainer(cfg);  // first: threads, the run's first line, torch's seed
    if (merges.empty()) merges = (std::filesystem::path(cfg.data.vocab_file).parent_path() / "vocab.bpe").string();
    const auto tok = Gpt2BpeTokenizer::from_files(cfg.data.vocab_file, merges);
    PT_INPUT_CHECK(tok.vocab_size() <= model_cfg.vocab_size, "model.vocab_size ", model_cfg.vocab_size,
                   " is smaller than the vocabulary in ", cfg.data.vocab_file, " (", tok.vocab_size(), ")");
    PT_INPUT_CHECK(cfg.data.max_seq_length <= model_cfg.n_positions, "data.max_seq_length (",
                   cfg.data.max_seq_length, ") exceeds model.n_positions (", model_cfg.n_positions, ")");

    auto dataset = TokenBlockDataset::build(
        cfg.data.train_files, [&tok](const std::string& para) { return tok.encode(para); }, -1, -1,
        cfg.data.max_seq_length);
    auto split = split_train_eval(dataset.size(), cfg.data.eval_fraction, cfg.trainer.seed);
    CausalLmBatchSource train(dataset, split.train), eval(dataset, split.eval);
    const bool main_rank = read_dist_env().rank == 0;
    if (main_rank)
      std::printf("data: %lld BPE tokens from %zu file(s) -> %lld blocks of %lld: %lld train, %lld eval\n",
                  static_cast<long long>(dataset.num_tokens()), cfg.data.train_files.size(),
                  static_cast<long long>(dataset.size()), static_cast<long long>(cfg.data.max_seq_length),
                  static_cast<long long>(train.size()), static_cast<long long>(eval.size()));

    Gpt2LMHeadModel model = init_from.empty() ? Gpt2LMHeadModel(model_cfg)
                                              : Gpt2LMHeadModel(Gpt2LMHeadModelImpl::from_pretrained(init_from));
    auto result = trainer.train(model.ptr(), train, eval.size() > 0 ? &eval : nullptr);
    if (main_rank && !save_hf.empty()) {
      model->save_pretrained(save_hf);
      save_gpt2_tokenizer(save_hf, cfg.data.vocab_file, merges, model_cfg.n_positions);
      std::printf("saved HF model and tokenizer (vocab.json, merges.txt) to %s\n", save_hf.c_str());
    }
    if (main_rank) std::printf("%s\n", result.done_line().c_str());
    return 0;
  });
}
