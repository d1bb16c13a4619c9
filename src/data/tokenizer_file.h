// What kind of tokenizer file a path holds, judged by its first bytes rather than its name, so
// that a tokenizer handed another tokenizer's file (a BERT vocab.txt to GPT-2, a .model to
// BERT) names the file it got and the one it needs. Parsing the file is left to each tokenizer.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

namespace polytrain {

enum class TokenizerFileKind {
  kEmpty,               ///< no bytes, or only whitespace
  kJson,                ///< starts with '{': GPT-2's encoder.json, HF vocab.json or tokenizer.json
  kSentencePieceModel,  ///< binary protobuf whose first field is a piece (a .model)
  kBinary,              ///< other bytes no text file has
  kWordPieceVocab,      ///< one token per line, no spaces (BERT's vocab.txt)
  kBpeMerges,           ///< "#version" header or two tokens per line (vocab.bpe, merges.txt)
  kSentencePieceVocab,  ///< piece<TAB>score per line (the .vocab written beside a .model)
  kPlainText,           ///< lines of words: a corpus rather than a vocabulary
};

/// The kind of a file whose first bytes are `head` (up to kTokenizerSniffBytes of it;
/// `truncated`: the file goes on, so head's last line may be cut).
TokenizerFileKind sniff_tokenizer_file(std::string_view head, bool truncated = false);
inline constexpr size_t kTokenizerSniffBytes = 64 * 1024;

/// "a WordPiece vocab.txt (one token per line; train_bert and train_albert read it)".
std::string describe(TokenizerFileKind kind);

/// What the file at `path` is (describe()) when it is one of the `refused` kinds, else "" (also
/// when it cannot be read: its loader says so). The loader words the error around it.
std::string refused_tokenizer_file(const std::string& path, std::initializer_list<TokenizerFileKind> refused);

}  // namespace polytrain
