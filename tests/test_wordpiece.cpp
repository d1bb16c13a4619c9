// WordPieceTokenizer against Hugging Face's reference ids for bert-base-uncased
// (tests/data/wordpiece_{cases,ref}.txt, from scripts/gen_wordpiece_ref.js), unit tests on a
// tiny handmade vocab, and the `tokenize` program's output and exit codes.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "polytrain/common/error.h"
#include "polytrain/data/wordpiece.h"
#include "helpers/process.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string join_ids(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(WordPieceReference, MatchesHuggingFaceOnEveryCase) {
  const std::string vocab = testing::asset_cache() + "/vocab/bert-base-uncased-vocab.txt";
  PT_SKIP_UNLESS(std::ifstream(vocab), vocab << " (scripts/fetch_assets.sh)");
  const auto tok = WordPieceTokenizer::from_vocab_file(vocab);
  ASSERT_EQ(tok.vocab_size(), 30522);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.unk_id(), 100);
  EXPECT_EQ(tok.cls_id(), 101);
  EXPECT_EQ(tok.sep_id(), 102);
  EXPECT_EQ(tok.mask_id(), 103);
  const std::string data = std::string(POLYTRAIN_SOURCE_DIR) + "/tests/data/";
  const auto cases = read_lines(data + "wordpiece_cases.txt");
  const auto ref = read_lines(data + "wordpiece_ref.txt");
  ASSERT_GE(cases.size(), 300u);
  ASSERT_EQ(cases.size(), ref.size());
  size_t matched = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string got = join_ids(tok.encode(cases[i]));
    EXPECT_EQ(got, ref[i]) << "case line " << i + 1 << ": " << cases[i];
    matched += got == ref[i];
  }
  EXPECT_EQ(matched, cases.size());
}

// A tiny vocab: id = index.
const std::vector<std::string> kTinyVocab = {
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",           // 0-4
    "un", "unaff", "##aff", "##able", "a", "##a", "##b",    // 5-11
    "the", "is", "!", ",", "cafe", "中", "b", "##s", "é"};  // 12-20

std::vector<std::string> tiny_tokens(const std::string& text, bool lowercase = true) {
  return WordPieceTokenizer(kTinyVocab, lowercase).tokenize(text);
}

using Tokens = std::vector<std::string>;

TEST(WordPieceTiny, GreedyLongestMatchFirst) {
  EXPECT_EQ(tiny_tokens("unaffable"), (Tokens{"unaff", "##able"}));
  EXPECT_EQ(tiny_tokens("unable"), (Tokens{"un", "##able"}));
  EXPECT_EQ(tiny_tokens("aab bs"), (Tokens{"a", "##a", "##b", "b", "##s"}));
}

TEST(WordPieceTiny, WordWithAnUnmatchedPartIsOneUnk) {
  EXPECT_EQ(tiny_tokens("the unaffablex is"), (Tokens{"the", "[UNK]", "is"}));
  EXPECT_EQ(tiny_tokens("xa"), (Tokens{"[UNK]"}));
}

TEST(WordPieceTiny, WordOverOneHundredCharsIsUnk) {
  const auto hundred = tiny_tokens(std::string(100, 'a'));
  ASSERT_EQ(hundred.size(), 100u);
  EXPECT_EQ(hundred[0], "a");
  EXPECT_EQ(hundred[99], "##a");
  EXPECT_EQ(tiny_tokens("the " + std::string(101, 'a') + " is"), (Tokens{"the", "[UNK]", "is"}));
  // Counted after normalization: 101 x (a + combining acute) is 101 chars once accents go.
  std::string accented;
  for (int i = 0; i < 60; ++i) accented += "a\xCC\x81";
  EXPECT_EQ(tiny_tokens(accented).size(), 60u);
}

TEST(WordPieceTiny, SpecialTokensInTextStayWhole) {
  EXPECT_EQ(tiny_tokens("the [MASK] is"), (Tokens{"the", "[MASK]", "is"}));
  EXPECT_EQ(tiny_tokens("a[MASK][SEP]b"), (Tokens{"a", "[MASK]", "[SEP]", "b"}));
  EXPECT_EQ(tiny_tokens("[CLS]"), (Tokens{"[CLS]"}));
  // Matched case-sensitively before lowercasing; otherwise brackets are punctuation.
  EXPECT_EQ(tiny_tokens("[mask]"), (Tokens{"[UNK]", "[UNK]", "[UNK]"}));
  EXPECT_EQ(tiny_tokens("[MASK"), (Tokens{"[UNK]", "[UNK]"}));
}

TEST(WordPieceTiny, NormalizesAndSplits) {
  EXPECT_EQ(tiny_tokens("CAFÉ!"), (Tokens{"cafe", "!"}));
  EXPECT_EQ(tiny_tokens("the,is"), (Tokens{"the", ",", "is"}));
  EXPECT_EQ(tiny_tokens("中中the"), (Tokens{"中", "中", "the"}));
  const char controls[] = "a\0b\x01 \t\xE2\x80\x8B the";  // NUL, SOH, tab, zero-width space
  EXPECT_EQ(tiny_tokens(std::string(controls, sizeof(controls) - 1)), (Tokens{"a", "##b", "the"}));
  EXPECT_EQ(tiny_tokens("a\xFF" "b"), (Tokens{"a", "##b"}));  // invalid UTF-8 byte dropped
  EXPECT_TRUE(tiny_tokens(" \t\r\n ").empty());
  // Without lowercasing nothing is folded: accents and case stay.
  EXPECT_EQ(tiny_tokens("é The", false), (Tokens{"é", "[UNK]"}));
  EXPECT_EQ(tiny_tokens("é", true), (Tokens{"[UNK]"}));  // "e" is not in the tiny vocab
}

TEST(WordPieceTiny, EncodeDecodeAndIds) {
  const WordPieceTokenizer tok(kTinyVocab);
  EXPECT_EQ(tok.encode("the unaffable!"), (std::vector<int64_t>{12, 6, 8, 14}));
  EXPECT_EQ(tok.encode("the", true), (std::vector<int64_t>{2, 12, 3}));
  EXPECT_EQ(tok.decode({2, 12, 6, 8, 14, 3}), "[CLS] the unaffable ! [SEP]");
  EXPECT_EQ(tok.decode({}), "");
  EXPECT_EQ(tok.vocab_size(), 21);
  EXPECT_EQ(tok.token_to_id("##able"), 8);
  EXPECT_EQ(tok.token_to_id("absent"), -1);
  EXPECT_EQ(tok.id_to_token(16), "cafe");
  EXPECT_THROW(tok.id_to_token(21), InputError);
  EXPECT_THROW(tok.decode({-1}), InputError);
  EXPECT_TRUE(tok.is_continuation(8));
  EXPECT_FALSE(tok.is_continuation(6));
  EXPECT_TRUE(tok.is_special(4));
  EXPECT_FALSE(tok.is_special(12));
  EXPECT_EQ(tok.mask_id(), 4);
}

TEST(WordPieceTiny, BadVocabs) {
  EXPECT_THROW(WordPieceTokenizer({}), InputError);
  EXPECT_THROW(WordPieceTokenizer({"a", "b"}), InputError);  // no [UNK]
  EXPECT_THROW(WordPieceTokenizer({"[UNK]", "a", "a"}), InputError);
  EXPECT_THROW(WordPieceTokenizer({"[UNK]"}).encode("a", true), InputError);  // no [CLS]/[SEP]

  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  auto message = [](const std::string& path) {
    try {
      WordPieceTokenizer::from_vocab_file(path);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(dir + "/absent_vocab.txt").find("absent_vocab.txt"), std::string::npos);
  write_file(dir + "/empty_vocab.txt", "");
  EXPECT_NE(message(dir + "/empty_vocab.txt").find("empty_vocab.txt' is empty"), std::string::npos);
  write_file(dir + "/dup_vocab.txt", "[UNK]\nthe\nis\nthe\n");
  const std::string dup = message(dir + "/dup_vocab.txt");
  EXPECT_NE(dup.find("dup_vocab.txt"), std::string::npos) << dup;
  EXPECT_NE(dup.find("duplicate token 'the' at line 4"), std::string::npos) << dup;
  write_file(dir + "/crlf_vocab.txt", "[UNK]\r\nthe\r\n");
  EXPECT_EQ(WordPieceTokenizer::from_vocab_file(dir + "/crlf_vocab.txt").token_to_id("the"), 1);
}

// Runs a shell command; returns its exit code.
int run(const std::string& command) { return testing::run_status(command); }

TEST(TokenizeProgram, PrintsIdsPerLineAndFailsCleanly) {
  const std::string bin = std::string(POLYTRAIN_BINARY_DIR) + "/tokenize";
  PT_SKIP_UNLESS(std::ifstream(bin), bin << " (built with the tests: cmake --build)");
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  std::string vocab_text;
  for (const auto& t : kTinyVocab) vocab_text += t + "\n";
  write_file(dir + "/tok_vocab.txt", vocab_text);
  write_file(dir + "/tok_in.txt", "the unaffable!\n\nthe [MASK] is\n");
  const std::string base = bin + " --vocab " + dir + "/tok_vocab.txt";

  ASSERT_EQ(run(base + " < " + dir + "/tok_in.txt > " + dir + "/tok_out.txt"), 0);
  EXPECT_EQ(read_lines(dir + "/tok_out.txt"), (std::vector<std::string>{"12 6 8 14", "", "12 4 13"}));
  ASSERT_EQ(run(base + " --type wordpiece --add_special_tokens < " + dir + "/tok_in.txt > " + dir +
                "/tok_out.txt"), 0);
  EXPECT_EQ(read_lines(dir + "/tok_out.txt"),
            (std::vector<std::string>{"2 12 6 8 14 3", "2 3", "2 12 4 13 3"}));

  for (const std::string& args : {std::string(" --bad_flag"), std::string(" --type bpe"),
                                  std::string(" --vocab /nonexistent/vocab.txt")}) {
    EXPECT_EQ(run(base + args + " < /dev/null > /dev/null 2> " + dir + "/tok_err.txt"), 2) << args;
    const auto err = read_lines(dir + "/tok_err.txt");
    ASSERT_EQ(err.size(), 1u) << args;
    EXPECT_EQ(err[0].rfind("error: ", 0), 0u) << err[0];
  }
}

}  // namespace
}  // namespace polytrain
