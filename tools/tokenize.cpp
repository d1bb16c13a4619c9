// `tokenize`: reads text lines on stdin and prints one line of space-separated token ids per
// input line. Only the WordPiece tokenizer exists so far (data/wordpiece.h); BPE and
// SentencePiece types are for later. Example: tokenize --vocab vocab.txt --add_special_tokens
#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

#include "common/error.h"
#include "common/main_guard.h"
#include "data/wordpiece.h"

namespace {

int tokenize_main(int argc, char** argv) {
  CLI::App app{"Tokenize stdin, one line of ids per input line"};
  std::string type = "wordpiece";
  std::string vocab_path;
  bool add_special_tokens = false;
  app.add_option("--type", type, "tokenizer type (only wordpiece so far)");
  app.add_option("--vocab", vocab_path, "vocab.txt, one token per line")->required();
  app.add_flag("--add_special_tokens", add_special_tokens, "wrap each line in [CLS] ... [SEP]");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    throw polytrain::InputError(e.what());
  }
  PT_INPUT_CHECK(type == "wordpiece", "--type ", type,
                 ": only the wordpiece tokenizer is available yet");

  const auto tokenizer = polytrain::WordPieceTokenizer::from_vocab_file(vocab_path);
  std::ios::sync_with_stdio(false);
  std::string line, out;
  while (std::getline(std::cin, line)) {
    out.clear();
    for (int64_t id : tokenizer.encode(line, add_special_tokens)) {
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
