// Declarations of the generated Unicode tables in data/unicode_tables.cpp (written by
// scripts/gen_unicode_tables.py): sorted, non-overlapping code point ranges and the fold map.
// Lookups and their meaning for BERT normalization live in data/wordpiece.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace polytrain::unicode_tables {

/// Inclusive code point range [first, last].
struct Range {
  char32_t first;
  char32_t last;
};

/// cp -> kFoldPool[offset, offset + length): its NFD without non-spacing marks, lowercased.
struct Fold {
  char32_t cp;
  uint16_t offset;
  uint8_t length;
};

extern const Range kControl[];      ///< removed by clean_text
extern const size_t kControlSize;
extern const Range kWhitespace[];   ///< replaced by ' ' in clean_text
extern const size_t kWhitespaceSize;
extern const Range kCjk[];          ///< padded with spaces (handle_chinese_chars)
extern const size_t kCjkSize;
extern const Range kStripped[];     ///< removed by NFD + strip_accents
extern const size_t kStrippedSize;
extern const Range kPunctuation[];  ///< split off as their own word by the pre-tokenizer
extern const size_t kPunctuationSize;
extern const Fold kFolds[];         ///< sorted by cp; Hangul syllables are decomposed in code
extern const size_t kFoldsSize;
extern const char32_t kFoldPool[];

}  // namespace polytrain::unicode_tables
