// The tokenizer half of a Hugging Face model folder, written next to what save_pretrained
// writes (config.json + model.safetensors) so that transformers' AutoTokenizer.from_pretrained
// finds the tokenizer the model was trained with: vocab.txt (WordPiece), vocab.json + merges.txt
// (GPT-2's byte-level BPE), spiece.model (SentencePiece), each with a tokenizer_config.json
// naming the tokenizer class. Reading those files is the data/ tokenizers' business.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace polytrain {

/// vocab.txt (one token per line, in id order) and tokenizer_config.json (BertTokenizer,
/// `do_lower_case` as the run tokenized, `model_max_length`).
void save_wordpiece_tokenizer(const std::string& dir, const std::vector<std::string>& vocab, bool do_lower_case,
                              int64_t model_max_length);

/// GPT-2's encoder.json and vocab.bpe copied as vocab.json and merges.txt (the same files under
/// transformers' names) and tokenizer_config.json (GPT2Tokenizer, `model_max_length`).
void save_gpt2_tokenizer(const std::string& dir, const std::string& encoder_json, const std::string& vocab_bpe,
                         int64_t model_max_length);

/// The SentencePiece model copied as spiece.model and tokenizer_config.json (T5Tokenizer with
/// `extra_ids` sentinels).
void save_t5_tokenizer(const std::string& dir, const std::string& spm_model, int64_t extra_ids,
                       int64_t model_max_length);

}  // namespace polytrain
