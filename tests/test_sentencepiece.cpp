// SentencePieceTokenizer on the corpus model of scripts/fetch_assets.sh: ids equal to
// python3-sentencepiece's on hundreds of corpus lines and hard cases, decode(encode(x)) round
// trips, T5's special and sentinel ids as HF T5Tokenizer numbers them, bad model files, and
// `tokenize --type sentencepiece`.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "polytrain/common/error.h"
#include "polytrain/data/sentencepiece_tokenizer.h"
#include "helpers/process.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

std::string cache() { return testing::asset_cache(); }
std::string model_path() { return cache() + "/spm/corpus.model"; }

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

// SentencePiece's default normaliser (nmt_nfkc) on ASCII text: runs of whitespace become one
// space, leading and trailing whitespace go. What decode(encode(x)) gives back.
std::string squeeze_spaces(const std::string& s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}
bool is_ascii(const std::string& s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

const std::vector<std::string> kHardCases = {
    "",
    "Hello world",
    "  leading and   inner   and trailing  ",
    "\ttabs\tand  spaces",
    "digits 0 12 345 6789 3.14159 1,000,000",
    "accents: café naïve résumé Ångström",
    "full\xef\xbd\x97idth ＡＢＣ ①② ﬁ",  // NFKC folds these
    "Привет, мир! 中文 emoji 😀",          // mostly outside the corpus alphabet: unk
    "<extra_id_0> is plain text to SentencePiece",
    "I'm you're DON'T 'tis -- \"quoted\" (parens) [brackets]",
};

class Spm : public ::testing::Test {
 protected:
  void SetUp() override {
    PT_SKIP_UNLESS(SentencePieceTokenizer::available(),
                   "SentencePiece in this build (Debian libsentencepiece-dev, then re-run cmake)");
    PT_SKIP_UNLESS(std::ifstream(model_path()), model_path() << " (scripts/fetch_assets.sh)");
    static const SentencePieceTokenizer tok = SentencePieceTokenizer::load(model_path(), 100, true);
    tok_ = &tok;
  }
  const SentencePieceTokenizer* tok_ = nullptr;
};

TEST_F(Spm, T5SpecialAndSentinelIds) {
  EXPECT_EQ(tok_->sp_size(), 8000);
  EXPECT_EQ(tok_->vocab_size(), 8100);
  EXPECT_EQ(tok_->pad_id(), 0);
  EXPECT_EQ(tok_->eos_id(), 1);
  EXPECT_EQ(tok_->unk_id(), 2);
  EXPECT_EQ(tok_->id_to_piece(0), "<pad>");
  EXPECT_EQ(tok_->id_to_piece(1), "</s>");
  EXPECT_EQ(tok_->id_to_piece(2), "<unk>");
  // HF T5Tokenizer: <extra_id_i> = vocab_size - 1 - i.
  EXPECT_EQ(tok_->sentinel_id(0), 8099);
  EXPECT_EQ(tok_->sentinel_id(99), 8000);
  EXPECT_EQ(tok_->id_to_piece(8099), "<extra_id_0>");
  EXPECT_EQ(tok_->id_to_piece(8000), "<extra_id_99>");
  EXPECT_EQ(tok_->piece_to_id("<extra_id_0>"), 8099);
  EXPECT_EQ(tok_->piece_to_id("<extra_id_42>"), 8057);
  EXPECT_EQ(tok_->piece_to_id("<extra_id_100>"), tok_->unk_id());  // only 100 of them
  EXPECT_TRUE(tok_->is_sentinel(8000));
  EXPECT_FALSE(tok_->is_sentinel(7999));
  EXPECT_THROW(tok_->sentinel_id(100), InputError);
  EXPECT_THROW(tok_->id_to_piece(8100), InputError);
  EXPECT_THROW(tok_->id_to_piece(-1), InputError);
  for (int64_t id = 0; id < tok_->sp_size(); id += 97) EXPECT_EQ(tok_->piece_to_id(tok_->id_to_piece(id)), id) << id;
  EXPECT_EQ(tok_->piece_to_id("no such piece at all"), tok_->unk_id());
  const auto the = tok_->encode("the");
  ASSERT_EQ(the.size(), 1u);
  EXPECT_EQ(tok_->id_to_piece(the[0]), "\xe2\x96\x81the");  // "▁the"
  auto with_eos = tok_->encode("the", true);
  EXPECT_EQ(with_eos, (std::vector<int64_t>{the[0], 1}));
  EXPECT_TRUE(tok_->encode("").empty());
}

// decode(encode(x)) gives x back up to SentencePiece's normalisation (whitespace squeezed).
TEST_F(Spm, DecodeInvertsEncode) {
  size_t checked = 0;
  for (const auto& file : {"mobydick.txt", "sherlock.txt"})
    for (const auto& line : corpus_lines(file, 400, 7)) {
      const auto ids = tok_->encode(line);
      for (int64_t id : ids) ASSERT_NE(id, tok_->unk_id()) << "corpus text is fully covered: " << line;
      if (!is_ascii(line)) continue;  // NFKC may change non-ASCII text
      EXPECT_EQ(tok_->decode(ids), squeeze_spaces(line));
      ++checked;
    }
  EXPECT_GE(checked, 700u);
  EXPECT_EQ(tok_->decode(tok_->encode(kHardCases[2])), "leading and inner and trailing");
  // pad and eos decode to nothing; sentinels to their names between the text runs.
  std::vector<int64_t> ids = tok_->encode("Call me");
  ids.push_back(tok_->sentinel_id(0));
  for (int64_t id : tok_->encode("Ishmael.")) ids.push_back(id);
  ids.push_back(tok_->sentinel_id(1));
  ids.push_back(tok_->eos_id());
  ids.push_back(tok_->pad_id());
  EXPECT_EQ(tok_->decode(ids), "Call me<extra_id_0>Ishmael.<extra_id_1>");
  EXPECT_THROW(tok_->decode({5, 8100}), InputError);
}

// The same model read by python3-sentencepiece (the library's own Python binding, run now).
TEST_F(Spm, MatchesPythonSentencePieceOnTheCorpusAndHardCases) {
  PT_SKIP_UNLESS(testing::python_imports("sentencepiece"),
                 "/usr/bin/python3 with sentencepiece (Debian python3-sentencepiece)");
  std::vector<std::string> texts = kHardCases;
  for (const auto& l : corpus_lines("mobydick.txt", 300, 37)) texts.push_back(l);
  for (const auto& l : corpus_lines("sherlock.txt", 300, 23)) texts.push_back(l);
  ASSERT_GE(texts.size(), 500u);
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  std::string joined;
  for (const auto& t : texts) joined += t + "\n";
  write_file(dir + "/spm_texts.txt", joined);
  const std::string script =
      "import sys, sentencepiece as spm\n"
      "sp = spm.SentencePieceProcessor(model_file=sys.argv[1])\n"
      "for line in open(sys.argv[2], encoding='utf-8', newline='\\n'):\n"
      "    ids = sp.encode(line[:-1])\n"
      "    print(' '.join(map(str, ids)), '|', sp.decode(ids), sep='')\n";
  write_file(dir + "/spm_ref.py", script);
  ASSERT_EQ(run("/usr/bin/python3 " + dir + "/spm_ref.py " + model_path() + " " + dir + "/spm_texts.txt > " + dir +
                "/spm_ref.txt"), 0);
  std::istringstream ref(slurp(dir + "/spm_ref.txt"));
  size_t tokens = 0, i = 0;
  for (std::string line; std::getline(ref, line); ++i) {
    ASSERT_LT(i, texts.size());
    const auto bar = line.find('|');
    ASSERT_NE(bar, std::string::npos) << line;
    std::vector<int64_t> want;
    std::istringstream ids(line.substr(0, bar));
    for (int64_t id; ids >> id;) want.push_back(id);
    const auto ours = tok_->encode(texts[i]);
    tokens += ours.size();
    EXPECT_EQ(ours, want) << "text " << i << ": " << texts[i];
    EXPECT_EQ(tok_->decode(ours), line.substr(bar + 1)) << "text " << i << ": " << texts[i];
  }
  EXPECT_EQ(i, texts.size());
  std::printf("compared %zu texts, %zu tokens\n", texts.size(), tokens);
}

TEST(SpmFiles, BadModelFilesAreInputErrorsNamingTheFile) {
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  const auto expect_error = [](const std::string& path, const std::string& what) {
    try {
      SentencePieceTokenizer::load(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const std::string built_without = "built without SentencePiece";
  const bool have = SentencePieceTokenizer::available();
  expect_error(dir + "/none.model", have ? "does not exist" : built_without);
  write_file(dir + "/garbage.model", std::string("\x0a\xff\xff\xff\x0fnot a model at all", 22));
  expect_error(dir + "/garbage.model", have ? "cannot be loaded" : built_without);
  write_file(dir + "/vocab.model", "[PAD]\n[UNK]\nthe\n");  // a WordPiece vocab is no model
  expect_error(dir + "/vocab.model", have ? "cannot be loaded" : built_without);
  write_file(dir + "/empty.model", "");
  expect_error(dir + "/empty.model", have ? "cannot be loaded" : built_without);
}

TEST_F(Spm, ModelWithoutT5IdsIsRefusedWhenT5IdsAreRequired) {
  PT_SKIP_UNLESS(testing::have_command("spm_train"), "spm_train on PATH (Debian sentencepiece)");
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  std::string text;
  for (const auto& l : corpus_lines("sherlock.txt", 2000, 1)) text += l + "\n";
  write_file(dir + "/spm_small.txt", text);
  ASSERT_EQ(run("cd " + dir + " && spm_train --input=spm_small.txt --model_prefix=spm_default --vocab_size=300 "
                "--num_threads=1 > /dev/null 2>&1"), 0);
  const std::string path = dir + "/spm_default.model";  // SentencePiece's defaults: unk 0, bos 1, eos 2
  const auto plain = SentencePieceTokenizer::load(path);
  EXPECT_EQ(plain.unk_id(), 0);
  EXPECT_EQ(plain.pad_id(), -1);
  try {
    SentencePieceTokenizer::load(path, 100, true);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("T5 needs pad 0, eos 1, unk 2"), std::string::npos) << e.what();
  }
}

TEST_F(Spm, TokenizeProgram) {
  const std::string bin = std::string(POLYTRAIN_BINARY_DIR) + "/tokenize";
  PT_SKIP_UNLESS(std::ifstream(bin), bin << " (built with the tests: cmake --build)");
  const testing::TempDir tmp;
  const std::string dir = tmp.str();
  write_file(dir + "/spm_in.txt", "Call me Ishmael.\n\nthe whale\n");
  ASSERT_EQ(run(bin + " --type sentencepiece --model " + model_path() + " < " + dir + "/spm_in.txt > " + dir +
                "/spm_out.txt"), 0);
  auto line = [&](const std::string& text, bool eos) {
    std::string s;
    for (int64_t id : tok_->encode(text, eos)) s += (s.empty() ? "" : " ") + std::to_string(id);
    return s + "\n";
  };
  EXPECT_EQ(slurp(dir + "/spm_out.txt"), line("Call me Ishmael.", false) + "\n" + line("the whale", false));
  ASSERT_EQ(run(bin + " --type sentencepiece --add_special_tokens --model " + model_path() + " < " + dir +
                "/spm_in.txt > " + dir + "/spm_out.txt"), 0);
  EXPECT_EQ(slurp(dir + "/spm_out.txt"), line("Call me Ishmael.", true) + "1\n" + line("the whale", true));
  EXPECT_EQ(run(bin + " --type sentencepiece < /dev/null 2> " + dir + "/spm_err.txt"), 2);
  EXPECT_EQ(slurp(dir + "/spm_err.txt"), "error: --type sentencepiece needs --model m.model\n");
  EXPECT_EQ(run(bin + " --type sentencepiece --model " + dir + "/none.model < /dev/null 2> " + dir + "/spm_err.txt"), 2);
  EXPECT_NE(slurp(dir + "/spm_err.txt").find("none.model' does not exist"), std::string::npos);
}

}  // namespace
}  // namespace polytrain
