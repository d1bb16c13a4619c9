// `tokenize`: reads text lines on stdin and prints one line of space-separated token ids per
// input line. Types: wordpiece (data/wordpiece.h; --vocab vocab.txt [--add_special_tokens]),
// bpe (GPT-2's byte-level BPE, data/gpt2_bpe.h; --vocab encoder.json --merges vocab.bpe) and
// sentencepiece (data/sentencepiece_tokenizer.h; --model m.model [--add_special_tokens: eos]).
#include <CLI/CLI.hpp>

#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/data/gpt2_bpe.h"
#include "polytrain/data/sentencepiece_tokenizer.h"
#include "polytrain/data/wordpiece.h"

namespace {

int tokenize_main(int argc, char** argv) {
  CLI::App app{"Tokenize stdin, one line of ids per input line"};
  std::string type = "wordpiece";
  std::string vocab_path, merges_path, model_path;
  bool add_special_tokens = false;
  app.add_option("--type", type, "tokenizer type: wordpiece (default), bpe (GPT-2) or sentencepiece");
  app.add_option("--vocab", vocab_path, "wordpiece: vocab.txt, one token per line; bpe: encoder.json");
  app.add_option("--merges", merges_path, "bpe: vocab.bpe (the merges)");
  app.add_option("--model", model_path, "sentencepiece: the .model file");
  app.add_flag("--add_special_tokens", add_special_tokens,
               "wordpiece: wrap each line in [CLS] ... [SEP]; sentencepiece: append eos (as T5Tokenizer)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    throw polytrain::InputError(e.what());
  }
  PT_INPUT_CHECK(type == "wordpiece" || type == "bpe" || type == "sentencepiece", "--type ", type,
                 ": unknown tokenizer type (expected wordpiece, bpe or sentencepiece)");
  PT_INPUT_CHECK(type == "sentencepiece" || !vocab_path.empty(), "--type ", type, " needs --vocab");
  PT_INPUT_CHECK(type != "sentencepiece" || !model_path.empty(), "--type sentencepiece needs --model m.model");
  PT_INPUT_CHECK(type == "sentencepiece" || model_path.empty(), "--model is for --type sentencepiece");
  PT_INPUT_CHECK(type != "bpe" || !merges_path.empty(), "--type bpe needs --merges vocab.bpe");
  PT_INPUT_CHECK(type != "bpe" || !add_special_tokens, "--add_special_tokens is for --type wordpiece");
  std::function<std::vector<int64_t>(const std::string&)> encode;
  if (type == "sentencepiece") {
    auto sp = std::make_shared<polytrain::SentencePieceTokenizer>(polytrain::SentencePieceTokenizer::load(model_path));
    encode = [sp, add_special_tokens](const std::string& line) { return sp->encode(line, add_special_tokens); };
  } else if (type == "bpe") {
    auto bpe = std::make_shared<polytrain::Gpt2BpeTokenizer>(
        polytrain::Gpt2BpeTokenizer::from_files(vocab_path, merges_path, "--vocab"));
    encode = [bpe](const std::string& line) { return bpe->encode(line); };
  } else {
    auto wp = std::make_shared<polytrain::WordPieceTokenizer>(
        polytrain::WordPieceTokenizer::from_vocab_file(vocab_path, "--vocab"));
    encode = [wp, add_special_tokens](const std::string& line) { return wp->encode(line, add_special_tokens); };
  }
  std::ios::sync_with_stdio(false);
  std::string line, out;
  while (std::getline(std::cin, line)) {
    out.clear();
    for (int64_t id : encode(line)) {
      if (!out.empty()) out.push_back(' ');
      out += std::to_string(id);
    }
    out.push_back('\n');
    std::cout << out;
  }
  std::cout.flush();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return polytrain::run_main([&] { return tokenize_main(argc, argv); });
}
