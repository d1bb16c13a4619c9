// Errors a newcomer meets first (issue 44): another tokenizer's file given to a tokenizer is
// named as such, by its content; a busy MASTER_PORT is one line naming --master_port, without
// c10d's log lines. Both in-process and through the programs (exit code 2, one error line).
// The swarm's busy --listen port: test_hivemind_errors_newcomer.cpp (built with hivemind only).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "helpers/free_port.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"
#include "polytrain/common/error.h"
#include "polytrain/data/gpt2_bpe.h"
#include "polytrain/data/sentencepiece_tokenizer.h"
#include "polytrain/data/tokenizer_file.h"
#include "polytrain/data/wordpiece.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/comm/gloo_communicator.h"

using namespace polytrain;
namespace pt = polytrain::testing;
using pt::TempDir;

namespace {

const std::string kWordPieceVocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n##s\nwhale\n";
const std::string kEncoderJson = R"({"!": 0, "\"": 1, "the": 2, "<|endoftext|>": 3})";
const std::string kMerges = "#version: 0.2\n\xC4\xA0 t\nh e\n";
// The first bytes of a SentencePiece ModelProto: piece "<pad>", score 0, type 3 (CONTROL).
const char kSpmModelBytes[] = "\x0a\x0e\x0a\x05<pad>\x15\x00\x00\x00\x00\x18\x03\x0a\x0c\x0a\x03</s>\x15\x00\x00\x00\x00";
const std::string kSpmModel(kSpmModelBytes, sizeof kSpmModelBytes - 1);
const std::string kSpmVocab = "<pad>\t0\n</s>\t0\n<unk>\t0\n\xE2\x96\x81the\t-3.1\n";
const std::string kProse = "Call me Ishmael. Some years ago, never mind how long precisely,\nhaving little money\n";

template <class F>
std::string error_of(F&& load) {
  try {
    load();
  } catch (const InputError& e) {
    return e.what();
  }
  return "no InputError";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TokenizerFileKind, IsJudgedByContent) {
  using K = TokenizerFileKind;
  EXPECT_EQ(sniff_tokenizer_file(kWordPieceVocab), K::kWordPieceVocab);
  EXPECT_EQ(sniff_tokenizer_file("[UNK]\r\nthe\r\n"), K::kWordPieceVocab);
  EXPECT_EQ(sniff_tokenizer_file(kEncoderJson), K::kJson);
  EXPECT_EQ(sniff_tokenizer_file("\xEF\xBB\xBF  {\"a\": 0}"), K::kJson);
  EXPECT_EQ(sniff_tokenizer_file(kMerges), K::kBpeMerges);
  EXPECT_EQ(sniff_tokenizer_file("a b\nab c\n"), K::kBpeMerges);
  EXPECT_EQ(sniff_tokenizer_file(kSpmModel), K::kSentencePieceModel);
  EXPECT_EQ(sniff_tokenizer_file(std::string("PK\x03\x04zip", 7)), K::kBinary);
  EXPECT_EQ(sniff_tokenizer_file(kSpmVocab), K::kSentencePieceVocab);
  EXPECT_EQ(sniff_tokenizer_file(kProse), K::kPlainText);
  EXPECT_EQ(sniff_tokenizer_file(""), K::kEmpty);
  EXPECT_EQ(sniff_tokenizer_file(" \n\n"), K::kEmpty);
  // A cut last line is not judged: "the whale" would make this prose.
  EXPECT_EQ(sniff_tokenizer_file("the\nwhale\nthe wh", true), K::kWordPieceVocab);
}

TEST(TokenizerFileKind, TheShippedAssetsAreWhatTheirNamesSay) {
  const std::string a = pt::asset_cache();
  PT_SKIP_UNLESS(std::ifstream(a + "/spm/corpus.model").good(), "assets (scripts/fetch_assets.sh)");
  const auto kind = [](const std::string& path) {
    const std::string text = slurp(path);
    const bool cut = text.size() > kTokenizerSniffBytes;
    return sniff_tokenizer_file(std::string_view(text).substr(0, kTokenizerSniffBytes), cut);
  };
  using K = TokenizerFileKind;
  EXPECT_EQ(kind(a + "/gpt2/encoder.json"), K::kJson);
  EXPECT_EQ(kind(a + "/gpt2/vocab.bpe"), K::kBpeMerges);
  EXPECT_EQ(kind(a + "/vocab/bert-base-uncased-vocab.txt"), K::kWordPieceVocab);
  EXPECT_EQ(kind(a + "/spm/corpus.model"), K::kSentencePieceModel);
  EXPECT_EQ(kind(a + "/spm/corpus.vocab"), K::kSentencePieceVocab);
  EXPECT_EQ(kind(a + "/corpus/mobydick.txt"), K::kPlainText);
}

TEST(TokenizerFiles, Gpt2NamesTheFileItGotAndTheOneItNeeds) {
  const TempDir tmp;
  const std::string vocab = tmp.write("vocab.txt", kWordPieceVocab), model = tmp.write("spiece.json", kSpmModel);
  const std::string merges = tmp.write("vocab.bpe", kMerges);
  const std::string needs =
      "; train_gpt2 needs GPT-2's encoder.json (a JSON object of token -> id), with vocab.bpe beside it or --merges";
  EXPECT_EQ(error_of([&] { Gpt2BpeTokenizer::from_files(vocab, merges); }),
            "data.vocab_file '" + vocab +
                "' is a WordPiece vocab.txt (one token per line, like BERT's, which train_bert and train_albert "
                "read)" + needs);
  EXPECT_EQ(error_of([&] { Gpt2BpeTokenizer::from_files(model, merges); }),
            "data.vocab_file '" + model +
                "' is a SentencePiece model (binary protobuf, like T5's spiece.model, which train_t5 reads)" + needs);
  const std::string hf = tmp.write("tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE"}})");
  EXPECT_NE(error_of([&] { Gpt2BpeTokenizer::from_files(hf, merges); }).find("' is a Hugging Face tokenizer.json"),
            std::string::npos);
  // The merges file too; and the key that named encoder.json is the caller's.
  const std::string enc = tmp.write("encoder.json", kEncoderJson);
  EXPECT_EQ(error_of([&] { Gpt2BpeTokenizer::from_files(enc, vocab, "--vocab"); }),
            "merges file '" + vocab +
                "' is a WordPiece vocab.txt (one token per line, like BERT's, which train_bert and train_albert "
                "read); train_gpt2 needs GPT-2's vocab.bpe (two tokens per line) beside --vocab, or --merges");
}

TEST(TokenizerFiles, WordPieceNamesTheFileItGotAndTheOneItNeeds) {
  const TempDir tmp;
  const std::string needs =
      "; train_bert and train_albert need a WordPiece vocab.txt (one token per line, like bert-base-uncased's)";
  const std::string enc = tmp.write("vocab.txt", kEncoderJson);  // the name does not matter
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_vocab_file(enc); }),
            "data.vocab_file '" + enc + "' is a JSON file (like GPT-2's encoder.json, which train_gpt2 reads)" + needs);
  const std::string model = tmp.write("spiece.model", kSpmModel);
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_vocab_file(model); }),
            "data.vocab_file '" + model +
                "' is a SentencePiece model (binary protobuf, like T5's spiece.model, which train_t5 reads)" + needs);
  const std::string prose = tmp.write("train.txt", kProse);
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_vocab_file(prose, "--vocab"); }),
            "--vocab '" + prose + "' is plain text (lines of words), not a tokenizer vocabulary" + needs);
  const std::string spm_vocab = tmp.write("corpus.vocab", kSpmVocab);
  EXPECT_NE(error_of([&] { WordPieceTokenizer::from_vocab_file(spm_vocab); }).find("' is a SentencePiece .vocab"),
            std::string::npos);
  EXPECT_EQ(WordPieceTokenizer::from_vocab_file(tmp.write("good.txt", kWordPieceVocab)).token_to_id("whale"), 7);
}

TEST(TokenizerFiles, SentencePieceNamesTheTextFileItGot) {
  const TempDir tmp;
  const std::string needs =
      "; train_t5 needs a SentencePiece .model (binary, like t5-small's spiece.model) as --spm_model or "
      "data.vocab_file";
  const std::string vocab = tmp.write("spiece.model", kWordPieceVocab);
  const std::string enc = tmp.write("enc.model", kEncoderJson);
  const std::string spm_vocab = tmp.write("corpus.vocab", kSpmVocab);
  if (!SentencePieceTokenizer::available()) {
    EXPECT_NE(error_of([&] { SentencePieceTokenizer::load(vocab); }).find("SentencePiece"), std::string::npos);
    GTEST_SKIP() << "no SentencePiece in this build: load() refuses every file before looking at it";
  }
  EXPECT_EQ(error_of([&] { SentencePieceTokenizer::load(vocab); }),
            "SentencePiece model '" + vocab +
                "' cannot be loaded: it is a WordPiece vocab.txt (one token per line, like BERT's, which train_bert "
                "and train_albert read)" + needs);
  EXPECT_EQ(error_of([&] { SentencePieceTokenizer::load(enc); }),
            "SentencePiece model '" + enc +
                "' cannot be loaded: it is a JSON file (like GPT-2's encoder.json, which train_gpt2 reads)" + needs);
  EXPECT_NE(error_of([&] { SentencePieceTokenizer::load(spm_vocab); })
                .find("cannot be loaded: it is a SentencePiece .vocab (piece<TAB>score per line; the model is the "
                      ".model file written beside it)"),
            std::string::npos);
}

// The programs as a user runs them: exit code 2, one `error:` line naming the key and the kind.
TEST(TokenizerFiles, ProgramsNameTheWrongFile) {
  const std::string a = pt::asset_cache();
  PT_SKIP_UNLESS(std::ifstream(a + "/spm/corpus.model").good(), "assets (scripts/fetch_assets.sh)");
  const TempDir tmp;
  const std::string bin = POLYTRAIN_BINARY_DIR;
  const std::string train = tmp.write("train.txt", kProse + kProse);
  const std::string common = " --train_files " + train + " --max_steps 1 --save_dir " + tmp.str("ckpt");
  auto r = pt::run_program(bin + "/train_gpt2 --config configs/gpt2_tiny.json --vocab_file " + a +
                                "/vocab/bert-base-uncased-vocab.txt" + common);
  pt::expect_one_line_error(r, "data.vocab_file '" + a + "/vocab/bert-base-uncased-vocab.txt' is a WordPiece "
                                    "vocab.txt (one token per line, like BERT's, which train_bert and train_albert "
                                    "read); train_gpt2 needs GPT-2's encoder.json");
  EXPECT_EQ(r.out.find("not valid JSON"), std::string::npos) << r.out;
  r = pt::run_program(bin + "/train_gpt2 --config configs/gpt2_tiny.json --vocab_file " + a +
                           "/spm/corpus.model" + common);
  pt::expect_one_line_error(r, "' is a SentencePiece model (binary protobuf, like T5's spiece.model, which "
                                    "train_t5 reads); train_gpt2 needs GPT-2's encoder.json");
  r = pt::run_program(bin + "/train_bert --config configs/bert_tiny.json --vocab_file " + a +
                           "/gpt2/encoder.json" + common);
  pt::expect_one_line_error(r, "data.vocab_file '" + a + "/gpt2/encoder.json' is a JSON file (like GPT-2's "
                                    "encoder.json, which train_gpt2 reads); train_bert and train_albert need a "
                                    "WordPiece vocab.txt");
}

// A TCP listener on `ip` (a loopback address) that another job holds, while this object lives.
class BusyTcpPort {
 public:
  int port = -1;
  explicit BusyTcpPort(const char* ip = "127.0.0.1") : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a = pt::loopback();
    ::inet_pton(AF_INET, ip, &a.sin_addr);
    socklen_t len = sizeof a;
    if (fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd_, 4) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
  }
  BusyTcpPort(const BusyTcpPort&) = delete;
  BusyTcpPort& operator=(const BusyTcpPort&) = delete;
  ~BusyTcpPort() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  int fd_;
};

// What this process writes to stderr (fd 2) while it lives: glog writes there directly.
class StderrCapture {
 public:
  explicit StderrCapture(const std::string& path) : path_(path), saved_(::dup(2)) {
    std::fflush(stderr);
    FILE* f = std::fopen(path.c_str(), "w");
    ::dup2(::fileno(f), 2);
    std::fclose(f);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    return slurp(path_);
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::string path_;
  int saved_;
};

// Held on MASTER_ADDR (127.0.0.1), rank 0's own check finds the port taken; held on 127.0.0.2
// only, the store's bind of every address fails, which c10d logs (three lines) unless quiet.
TEST(Rendezvous, BusyMasterPortIsOneLineNamingTheFlagWithoutC10dLogLines) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  for (const char* busy_ip : {"127.0.0.1", "127.0.0.2"}) {
    SCOPED_TRACE(busy_ip);
    const BusyTcpPort busy(busy_ip);
    ASSERT_GT(busy.port, 0);
    const TempDir tmp;
    std::string error = "no InputError", logged;
    {
      StderrCapture capture(tmp.str("stderr.txt"));
      try {
        make_gloo_communicator(0, 2, "127.0.0.1", busy.port, std::chrono::seconds(2));
      } catch (const InputError& e) {
        error = e.what();
      }
      logged = capture.text();
    }
    EXPECT_EQ(error, "127.0.0.1:" + std::to_string(busy.port) +
                         " (MASTER_ADDR:MASTER_PORT): address in use: another job holds it; pass --master_port "
                         "with a free port");
    EXPECT_EQ(logged, "");
  }
}

// Rank 0 of a 2-rank train_gpt2 whose MASTER_PORT another job holds on `busy_ip`.
struct ProgramRun {
  pt::ProgramRun run;
  int port;
};
ProgramRun rank0_of_two(const char* busy_ip, const std::string& env = "") {
  const BusyTcpPort busy(busy_ip);
  EXPECT_GT(busy.port, 0);
  const TempDir tmp;
  std::string text;
  for (int i = 0; i < 64; ++i) text += kProse;  // blocks of 128 tokens for both ranks' first batch
  const std::string train = tmp.write("train.txt", text);
  // Rank 0 of 2, as launch starts it: it hosts the rendezvous.
  return {pt::run_program(env + " RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
                          "MASTER_PORT=" + std::to_string(busy.port) + " " POLYTRAIN_BINARY_DIR "/train_gpt2 "
                          "--config configs/gpt2_tiny.json --env_type pytorchDDP --train_batch_size 32 --max_steps 1 "
                          "--train_files " + train + " --save_dir " + tmp.str("ckpt")),
          busy.port};
}

TEST(Rendezvous, BusyMasterPortFailsTheProgramWithOneLine) {
  PT_SKIP_UNLESS(comm_engine_available("gloo"), "Gloo in this build (Debian libgloo-dev, then re-run cmake)");
  PT_SKIP_UNLESS(std::ifstream(pt::asset_cache() + "/gpt2/encoder.json").good(), "assets (scripts/fetch_assets.sh)");
  for (const char* busy_ip : {"127.0.0.1", "127.0.0.2"}) {
    SCOPED_TRACE(busy_ip);
    const auto [r, port] = rank0_of_two(busy_ip);
    pt::expect_one_line_error(r, "127.0.0.1:" + std::to_string(port) +
                                     " (MASTER_ADDR:MASTER_PORT): address in use: another job holds it; pass "
                                     "--master_port with a free port");
    EXPECT_EQ(r.out.find("socket.cpp"), std::string::npos) << r.out;  // glog's "[W socket.cpp:...]"
    EXPECT_EQ(r.out.find("[c10d]"), std::string::npos) << r.out;
  }
  // What was kept off the console, asked for as in PyTorch.
  const auto [r, port] = rank0_of_two("127.0.0.2", "TORCH_CPP_LOG_LEVEL=INFO");
  pt::expect_one_line_error(r, "(MASTER_ADDR:MASTER_PORT): address in use");
  EXPECT_NE(r.out.find("[c10d] The server socket has failed to listen on any local network address."),
            std::string::npos) << r.out;
}

}  // namespace
