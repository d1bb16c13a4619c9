// Gpt2BpeTokenizer against GPT-2's real ids: hundreds of corpus lines and hard cases encoded by
// npm gpt-3-encoder and js-tiktoken (run through node by tests/bpe_reference.js), known ids,
// the pre-tokenizer's splits, malformed files, and `tokenize --type bpe`.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "polytrain/common/error.h"
#include "polytrain/data/gpt2_bpe.h"
#include "helpers/process.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

std::string cache() { return testing::asset_cache(); }
std::string encoder_json() { return cache() + "/gpt2/encoder.json"; }
std::string merges_bpe() { return cache() + "/gpt2/vocab.bpe"; }

class Bpe : public ::testing::Test {
 protected:
  void SetUp() override {
    PT_SKIP_UNLESS(Gpt2BpeTokenizer::available(), "PCRE2 in this build (Debian libpcre2-dev, then re-run cmake)");
    PT_SKIP_UNLESS(std::ifstream(encoder_json()) && std::ifstream(merges_bpe()),
                   encoder_json() << " and " << merges_bpe() << " (scripts/fetch_assets.sh)");
    static const Gpt2BpeTokenizer tok = Gpt2BpeTokenizer::from_files(encoder_json(), merges_bpe());
    tok_ = &tok;
  }
  const Gpt2BpeTokenizer* tok_ = nullptr;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

int run(const std::string& command) { return testing::run_status(command); }

// Every k-th non-empty line of a corpus file, up to n lines, without its line end.
std::vector<std::string> corpus_lines(const std::string& file, size_t n, size_t k) {
  std::ifstream in(cache() + "/corpus/" + file, std::ios::binary);
  std::vector<std::string> out;
  size_t i = 0;
  for (std::string line; out.size() < n && std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty() && i++ % k == 0) out.push_back(line);
  }
  return out;
}

const std::vector<std::string> kHardCases = {
    "",
    "Hello world",
    "I'm you're they've we'll she'd it's can't DON'T 'tis y'all",
    "He said 'sup' and 'll' and ''s",
    "runs   of    spaces",
    "  leading and trailing  ",
    " ",
    "\t tabs\t\tand\ttabs \t",
    "line one\nline two\n\nline four\n",
    "windows\r\nline ends\r\n",
    "\n\n\n",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-11-23 007",
    "٣٤٥ ⅫⅣ ²³ mixed123abc",
    "emoji 😀😃 👍🏽 👨‍👩‍👧 ❤️ 🇩🇪",
    "Привет, мир! Ελληνικά. עברית. العربية.",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "accents: café naïve résumé Ångström",
    "punctuation!!! ??? ... --- ((()))[]{}<>@#$%^&*_+=|\\/~`",
    "<|endoftext|> is text here",
    "zero\xe2\x80\x8b" "width space and non\xc2\xa0" "breaking space",
    "a\u3000ideographic space",
    "https://example.com/path?q=1&r=two#frag",
    "CamelCaseWords and snake_case_words and kebab-case-words",
    "    def f(x):\n        return x ** 2  # comment\n",
};

TEST_F(Bpe, KnownIds) {
  EXPECT_EQ(tok_->encode("Hello world"), (std::vector<int64_t>{15496, 995}));
  EXPECT_EQ(tok_->encode("hello world"), (std::vector<int64_t>{31373, 995}));
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->eos_id(), 50256);
  EXPECT_EQ(tok_->id_to_token(995), "\xc4\xa0world");  // "Ġworld": the space is byte-mapped
  EXPECT_TRUE(tok_->encode("").empty());
}

TEST_F(Bpe, PretokenizerSplitsAsGpt2) {
  EXPECT_EQ(Gpt2BpeTokenizer::pretokenize("I'm  here"), (std::vector<std::string>{"I", "'m", " ", " here"}));
  EXPECT_EQ(Gpt2BpeTokenizer::pretokenize("a1 22!!\n\n b"),
            (std::vector<std::string>{"a", "1", " 22", "!!", "\n\n", " b"}));
  for (const auto& text : kHardCases) {
    std::string joined;
    for (const auto& p : Gpt2BpeTokenizer::pretokenize(text)) joined += p;
    EXPECT_EQ(joined, text);
  }
}

TEST_F(Bpe, DecodeInvertsEncode) {
  for (const auto& text : kHardCases) EXPECT_EQ(tok_->decode(tok_->encode(text)), text);
  EXPECT_THROW(tok_->decode({50257}), InputError);
  // Invalid UTF-8 is read as U+FFFD, as a JavaScript reader of the bytes would.
  EXPECT_EQ(tok_->decode(tok_->encode("a\xff" "b")), "a\xef\xbf\xbd" "b");
}

// The ids of npm gpt-3-encoder and js-tiktoken ("gpt2"), computed now by node.
TEST_F(Bpe, MatchesGpt3EncoderAndTiktokenOnTheCorpusAndHardCases) {
  const std::string modules = cache() + "/npm/node_modules";
  PT_SKIP_UNLESS(testing::have_command("node"), "node on PATH (Debian nodejs)");
  PT_SKIP_UNLESS(std::ifstream(modules + "/js-tiktoken/package.json"),
                 "the npm reference encoders in " << modules << " (scripts/fetch_assets.sh)");
  std::vector<std::string> texts = kHardCases;
  for (const auto& l : corpus_lines("mobydick.txt", 250, 37)) texts.push_back(l);
  for (const auto& l : corpus_lines("sherlock.txt", 250, 23)) texts.push_back(l);
  // Whole paragraphs too: newlines and runs of them inside one text.
  const std::string book = slurp(cache() + "/corpus/sherlock.txt");
  for (size_t off = 1000; off + 3000 < book.size() && texts.size() < 560; off += book.size() / 40)
    texts.push_back(book.substr(off, 3000));
  ASSERT_GE(texts.size(), 500u);

  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  write_file(dir + "/bpe_texts.json", nlohmann::json(texts).dump());
  ASSERT_EQ(run("node " POLYTRAIN_SOURCE_DIR "/tests/bpe_reference.js " + modules + " " + dir +
                "/bpe_texts.json > " + dir + "/bpe_ref.json"), 0);
  const auto ref = nlohmann::json::parse(slurp(dir + "/bpe_ref.json"));
  size_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto ours = tok_->encode(texts[i]);
    tokens += ours.size();
    EXPECT_EQ(ours, ref["gpt3"][i].get<std::vector<int64_t>>()) << "gpt-3-encoder, text " << i << ": " << texts[i];
    EXPECT_EQ(ours, ref["tiktoken"][i].get<std::vector<int64_t>>()) << "js-tiktoken, text " << i << ": " << texts[i];
  }
  std::printf("compared %zu texts, %zu tokens\n", texts.size(), tokens);
}

TEST(BpeFiles, MalformedFilesAreInputErrorsNamingTheFile) {
  PT_SKIP_UNLESS(Gpt2BpeTokenizer::available(), "PCRE2 in this build (Debian libpcre2-dev, then re-run cmake)");
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  const auto expect_error = [](const std::string& enc, const std::string& merges, const std::string& what) {
    try {
      Gpt2BpeTokenizer::from_files(enc, merges);
      ADD_FAILURE() << "no error, expected " << what;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(dir + "/none.json", dir + "/none.bpe", "none.json' cannot be read");
  write_file(dir + "/bad.json", "{\"a\": 0,");
  expect_error(dir + "/bad.json", dir + "/none.bpe", "bad.json: not valid JSON");
  // A tiny alphabet: every byte, then "ab".
  nlohmann::json enc;
  {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : next++;
      std::string s;
      if (c < 0x80) s.push_back(static_cast<char>(c));
      else if (c < 0x800) { s.push_back(static_cast<char>(0xC0 | (c >> 6))); s.push_back(static_cast<char>(0x80 | (c & 0x3F))); }
      enc[s] = b;
    }
  }
  enc["ab"] = 256;
  write_file(dir + "/tiny.json", enc.dump());
  write_file(dir + "/tiny.bpe", "#version: 0.2\na b\n");
  const auto tiny = Gpt2BpeTokenizer::from_files(dir + "/tiny.json", dir + "/tiny.bpe");
  // "abab" -> ab ab; " a" -> the space's symbol (id 32 here, "\u0120") and a: no merge.
  EXPECT_EQ(tiny.encode("abab a"), (std::vector<int64_t>{256, 256, 32, 'a'}));
  write_file(dir + "/bad.bpe", "#version: 0.2\na b\nab\n");
  expect_error(dir + "/tiny.json", dir + "/bad.bpe", "bad.bpe:3: expected two tokens");
  write_file(dir + "/bad2.bpe", "a b\nab c\n");
  expect_error(dir + "/tiny.json", dir + "/bad2.bpe", "bad2.bpe:2: merge 'ab c' uses or makes a token");
  write_file(dir + "/empty.bpe", "#version: 0.2\n");
  expect_error(dir + "/tiny.json", dir + "/empty.bpe", "empty.bpe: no merges");
}

TEST_F(Bpe, TokenizeProgram) {
  const std::string bin = std::string(POLYTRAIN_BINARY_DIR) + "/tokenize";
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  write_file(dir + "/bpe_in.txt", "Hello world\n\nhello world\n");
  ASSERT_EQ(run(bin + " --type bpe --vocab " + encoder_json() + " --merges " + merges_bpe() + " < " + dir +
                "/bpe_in.txt > " + dir + "/bpe_out.txt"), 0);
  EXPECT_EQ(slurp(dir + "/bpe_out.txt"), "15496 995\n\n31373 995\n");
  EXPECT_EQ(run(bin + " --type bpe --vocab " + encoder_json() + " < /dev/null 2> " + dir + "/bpe_err.txt"), 2);
  EXPECT_EQ(slurp(dir + "/bpe_err.txt"), "error: --type bpe needs --merges vocab.bpe\n");
}

}  // namespace
}  // namespace polytrain
