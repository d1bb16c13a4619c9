// SentencePieceTokenizer: a .model file read by libsentencepiece's SentencePieceProcessor (the
// segmentation is the library's, not reimplemented), plus T5's 100 sentinel ids <extra_id_N>
// appended after the model's pieces as Hugging Face's T5Tokenizer numbers them. Optional in a
// build (POLYTRAIN_WITH_SENTENCEPIECE): without the library, load() throws InputError.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace polytrain {

class SentencePieceTokenizer {
 public:
  /// T5's default: 100 sentinels <extra_id_0>..<extra_id_99>.
  static constexpr int64_t kDefaultExtraIds = 100;

  /// Whether this build has libsentencepiece (tests skip when not).
  static bool available();

  /// Loads a SentencePiece model file. InputError naming the file when it is missing, not a
  /// SentencePiece model, or the build has no SentencePiece; also when the model's pad, eos and
  /// unk are not 0, 1 and 2 while `require_t5_ids` (T5's fixed layout, as the corpus model has).
  static SentencePieceTokenizer load(const std::string& model_path, int64_t extra_ids = kDefaultExtraIds,
                                     bool require_t5_ids = false);

  /// Piece ids of `text` as SentencePiece segments it (normalisation included); no eos unless
  /// `add_eos`. Sentinel text like "<extra_id_0>" is not recognised here: it is ordinary text.
  std::vector<int64_t> encode(const std::string& text, bool add_eos = false) const;
  /// Text of `ids`: runs of model ids decoded by SentencePiece (pad/eos/control ids vanish,
  /// "▁" becomes a space), sentinel ids written as "<extra_id_N>". InputError on ids outside
  /// [0, vocab_size()).
  std::string decode(const std::vector<int64_t>& ids) const;

  /// Piece of an id: the model's piece, or "<extra_id_N>" for sentinels. InputError when out of range.
  std::string id_to_piece(int64_t id) const;
  /// Id of a piece or "<extra_id_N>"; unk_id() for an unknown piece (as SentencePiece does).
  int64_t piece_to_id(const std::string& piece) const;

  /// The model's own pieces (sp_model.get_piece_size()).
  int64_t sp_size() const { return sp_size_; }
  /// The extended vocabulary: sp_size() + extra_ids() (HF T5Tokenizer.vocab_size).
  int64_t vocab_size() const { return sp_size_ + extra_ids_; }
  int64_t extra_ids() const { return extra_ids_; }
  /// <extra_id_i> = vocab_size() - 1 - i (HF T5Tokenizer). InputError when i is out of range.
  int64_t sentinel_id(int64_t i) const;
  /// Whether id is one of the sentinels.
  bool is_sentinel(int64_t id) const { return id >= sp_size_ && id < vocab_size(); }

  /// -1 when the model has none (as SentencePiece reports it).
  int64_t pad_id() const { return pad_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t unk_id() const { return unk_id_; }
  const std::string& model_path() const { return path_; }

 private:
  struct Impl;  // the SentencePieceProcessor; shared so copies are cheap and stay const
  std::shared_ptr<const Impl> impl_;
  std::string path_;
  int64_t sp_size_ = 0;
  int64_t extra_ids_ = 0;
  int64_t pad_id_ = -1, eos_id_ = -1, unk_id_ = -1;
};

}  // namespace polytrain
