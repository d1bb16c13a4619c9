#include "polytrain/trainer/hf_tokenizer_files.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "polytrain/common/atomic_file.h"

namespace polytrain {

namespace fs = std::filesystem;

namespace {

void write_in(const std::string& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  atomic_write_file((fs::path(dir) / name).string(), bytes);
}

void write_config(const std::string& dir, nlohmann::json config) {
  write_in(dir, "tokenizer_config.json", config.dump(2) + "\n");
}

}  // namespace

void save_wordpiece_tokenizer(const std::string& dir, const std::vector<std::string>& vocab, bool do_lower_case,
                              int64_t model_max_length) {
  std::string text;
  for (const auto& token : vocab) text += token + "\n";
  write_in(dir, "vocab.txt", text);
  write_config(dir, {{"tokenizer_class", "BertTokenizer"},
                     {"do_lower_case", do_lower_case},
                     {"model_max_length", model_max_length},
                     {"unk_token", "[UNK]"},
                     {"sep_token", "[SEP]"},
                     {"pad_token", "[PAD]"},
                     {"cls_token", "[CLS]"},
                     {"mask_token", "[MASK]"}});
}

void save_gpt2_tokenizer(const std::string& dir, const std::string& encoder_json, const std::string& vocab_bpe,
                         int64_t model_max_length) {
  write_in(dir, "vocab.json", read_file(encoder_json));
  write_in(dir, "merges.txt", read_file(vocab_bpe));
  write_config(dir, {{"tokenizer_class", "GPT2Tokenizer"},
                     {"model_max_length", model_max_length},
                     {"bos_token", "<|endoftext|>"},
                     {"eos_token", "<|endoftext|>"},
                     {"unk_token", "<|endoftext|>"}});
}

void save_t5_tokenizer(const std::string& dir, const std::string& spm_model, int64_t extra_ids,
                       int64_t model_max_length) {
  write_in(dir, "spiece.model", read_file(spm_model));
  write_config(dir, {{"tokenizer_class", "T5Tokenizer"},
                     {"extra_ids", extra_ids},
                     {"model_max_length", model_max_length},
                     {"eos_token", "</s>"},
                     {"unk_token", "<unk>"},
                     {"pad_token", "<pad>"}});
}

}  // namespace polytrain
