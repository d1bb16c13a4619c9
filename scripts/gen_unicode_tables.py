#!/usr/bin/env python3
# Generates src/data/unicode_tables.cpp: the per-character Unicode facts BERT's WordPiece
# normalizer and pre-tokenizer need (clean_text, CJK, NFD + accent strip + lowercase,
# punctuation), from Python's unicodedata. The tokenizer logic itself is in data/wordpiece.cpp.
#
# Usage: python3 scripts/gen_unicode_tables.py [--check PROBE] > src/data/unicode_tables.cpp
#   --check PROBE: compare every code point against a dump of Hugging Face tokenizers'
#   BertNormalizer / BertPreTokenizer (`node scripts/gen_wordpiece_ref.js --unicode-probe F`)
#   and exit 1 on any difference.
import sys
import unicodedata as ud

# ---- Hugging Face parity -------------------------------------------------------------------
# The reference (Rust `tokenizers`, npm tokenizers@0.23.2) takes categories from the
# `unicode_categories` crate (Unicode 8-era tables), NFD from `unicode-normalization-alignments`
# and lowercase from Rust's std (Unicode 16). Python here has a different Unicode version, so
# these overrides (found with --check) make the tables reproduce the reference exactly.
# Marks (Mn) and format chars (Cf) newer than HF's tables: HF neither strips nor removes them.
HF_KEEP = [(0x7FD, 0x7FD), (0x890, 0x891), (0x898, 0x89F), (0x8CA, 0x8E2), (0x9FE, 0x9FE),
    (0xAFA, 0xAFF), (0xB55, 0xB55), (0xC04, 0xC04), (0xC3C, 0xC3C), (0xD00, 0xD00),
    (0xD3B, 0xD3C), (0xD81, 0xD81), (0xEBA, 0xEBA), (0x180F, 0x180F), (0x1885, 0x1886),
    (0x1ABF, 0x1ACE), (0x1DF6, 0x1DFB), (0xA82C, 0xA82C), (0xA8C5, 0xA8C5), (0xA8FF, 0xA8FF),
    (0xA9BD, 0xA9BD), (0x10D24, 0x10D27), (0x10EAB, 0x10EAC), (0x10F46, 0x10F50),
    (0x10F82, 0x10F85), (0x11070, 0x11070), (0x11073, 0x11074), (0x110C2, 0x110C2),
    (0x110CD, 0x110CD), (0x111C9, 0x111C9), (0x111CF, 0x111CF), (0x1123E, 0x1123E),
    (0x1133B, 0x1133B), (0x11438, 0x1143F), (0x11442, 0x11444), (0x11446, 0x11446),
    (0x1145E, 0x1145E), (0x1182F, 0x11837), (0x11839, 0x1183A), (0x1193B, 0x1193C),
    (0x1193E, 0x1193E), (0x11943, 0x11943), (0x119D4, 0x119D7), (0x119DA, 0x119DB),
    (0x119E0, 0x119E0), (0x11A01, 0x11A0A), (0x11A33, 0x11A38), (0x11A3B, 0x11A3E),
    (0x11A47, 0x11A47), (0x11A51, 0x11A56), (0x11A59, 0x11A5B), (0x11A8A, 0x11A96),
    (0x11A98, 0x11A99), (0x11C30, 0x11C36), (0x11C38, 0x11C3D), (0x11C3F, 0x11C3F),
    (0x11C92, 0x11CA7), (0x11CAA, 0x11CB0), (0x11CB2, 0x11CB3), (0x11CB5, 0x11CB6),
    (0x11D31, 0x11D36), (0x11D3A, 0x11D3A), (0x11D3C, 0x11D3D), (0x11D3F, 0x11D45),
    (0x11D47, 0x11D47), (0x11D90, 0x11D91), (0x11D95, 0x11D95), (0x11D97, 0x11D97),
    (0x11EF3, 0x11EF4), (0x13430, 0x13438), (0x16F4F, 0x16F4F), (0x16FE4, 0x16FE4),
    (0x1CF00, 0x1CF2D), (0x1CF30, 0x1CF46), (0x1E000, 0x1E006), (0x1E008, 0x1E018),
    (0x1E01B, 0x1E021), (0x1E023, 0x1E024), (0x1E026, 0x1E02A), (0x1E130, 0x1E136),
    (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF), (0x1E944, 0x1E94A)]
HF_STRIP = {0x1734}            # Mc now, Mn in HF's tables: stripped like an accent
HF_NO_DECOMPOSE = {0x11938}    # canonical decomposition newer than HF's NFD tables
# Case pairs newer than Python's tables (Unicode 15/16), lowercased by HF.
HF_LOWER = {0x1C89: 0x1C8A, 0xA7CB: 0x264, 0xA7CC: 0xA7CD, 0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3,
            0xA7D4: 0xA7D5, 0xA7DA: 0xA7DB, 0xA7DC: 0x19B}
HF_LOWER.update({c: c + 0x20 for c in range(0x10D50, 0x10D66)})
HF_LOWER.update({c: c + 0x1B for c in range(0x16EA0, 0x16EB9)})
# Punctuation newer than HF's tables (not split off), and two older classifications.
HF_NOT_PUNCT = [(0x61D, 0x61D), (0x9FD, 0x9FD), (0xA76, 0xA76), (0xC77, 0xC77), (0xC84, 0xC84),
    (0x1B7D, 0x1B7E), (0x2E43, 0x2E4F), (0x2E52, 0x2E5D), (0x10EAD, 0x10EAD), (0x10F55, 0x10F59),
    (0x10F86, 0x10F89), (0x1144B, 0x1144F), (0x1145A, 0x1145B), (0x1145D, 0x1145D),
    (0x11660, 0x1166C), (0x116B9, 0x116B9), (0x1183B, 0x1183B), (0x11944, 0x11946),
    (0x119E2, 0x119E2), (0x11A3F, 0x11A46), (0x11A9A, 0x11A9C), (0x11A9E, 0x11AA2),
    (0x11C41, 0x11C45), (0x11C70, 0x11C71), (0x11EF7, 0x11EF8), (0x11FFF, 0x11FFF),
    (0x12FF1, 0x12FF2), (0x16E97, 0x16E9A), (0x16FE2, 0x16FE2), (0x1E95E, 0x1E95F)]
HF_PUNCT = {0x166D, 0x111C9}

# ---- the rules (HF tokenizers normalizers/bert.rs, pre_tokenizers/bert.rs) ----------------
# Rust's char::is_whitespace (the White_Space property).
WHITESPACE = [(0x9, 0xD), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
              (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
              (0x3000, 0x3000)]
CJK = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
       (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]
HANGUL = (0xAC00, 0xD7A3)  # decomposed algorithmically in C++
ASCII_PUNCT = set(range(0x21, 0x30)) | set(range(0x3A, 0x41)) | set(range(0x5B, 0x61)) | \
    set(range(0x7B, 0x7F))


def in_ranges(c, ranges):
    return any(a <= c <= b for a, b in ranges)


def is_control(c):  # removed by clean_text (with NUL and U+FFFD); \t \n \r are whitespace
    if c in (0x9, 0xA, 0xD) or in_ranges(c, HF_KEEP):
        return False
    return c == 0 or c == 0xFFFD or ud.category(chr(c)) in ('Cc', 'Cf', 'Co', 'Cs')


def is_stripped_char(ch):  # dropped by strip_accents after NFD
    c = ord(ch)
    if c in HF_STRIP:
        return True
    return ud.category(ch) == 'Mn' and not in_ranges(c, HF_KEEP)


def lower_char(ch):
    return chr(HF_LOWER[ord(ch)]) if ord(ch) in HF_LOWER else ch.lower()


def fold(c):
    """NFD, drop non-spacing marks, lowercase: what a kept character becomes."""
    nfd = chr(c) if c in HF_NO_DECOMPOSE else ud.normalize('NFD', chr(c))
    return ''.join(lower_char(ch) for ch in nfd if not is_stripped_char(ch))


def is_punct(c):
    if c in HF_PUNCT:
        return True
    if in_ranges(c, HF_NOT_PUNCT):
        return False
    return c in ASCII_PUNCT or ud.category(chr(c)).startswith('P')


def code_points():
    return (c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def to_ranges(cps):
    out = []
    for c in cps:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def normalize_one(c):  # the reference's normalizer applied to one character
    if is_control(c):
        return ''
    if in_ranges(c, WHITESPACE):
        return ' '
    if 0xD7A3 >= c >= 0xAC00:
        f = ud.normalize('NFD', chr(c))
    else:
        f = fold(c)
    return ' ' + f + ' ' if in_ranges(c, CJK) else f


def check(probe_path):
    ref = {}
    for line in open(probe_path, encoding='utf-8'):
        cp, cls, out = line.rstrip('\n').split(' ')
        ref[int(cp, 16)] = (cls, ''.join(chr(int(x, 16)) for x in out.split(',') if x))
    bad = 0
    for c in code_points():
        cls, out = ref.get(c, ('o', chr(c)))
        mine = normalize_one(c)
        if mine != out or (cls == 'p') != is_punct(c):
            bad += 1
            if bad <= 20:
                print('U+%04X: normalized %r vs %r, punct %s vs %s' % (c, mine, out, is_punct(c), cls),
                      file=sys.stderr)
    print('%d code points differ from %s' % (bad, probe_path), file=sys.stderr)
    return bad == 0


def emit_ranges(name, ranges, comment):
    lines = ['// ' + comment, 'const Range %s[] = {' % name]
    row = []
    for a, b in ranges:
        row.append('{0x%X, 0x%X}' % (a, b))
        if len(row) == 6:
            lines.append('    ' + ', '.join(row) + ',')
            row = []
    if row:
        lines.append('    ' + ', '.join(row) + ',')
    lines.append('};')
    lines.append('const size_t %sSize = sizeof(%s) / sizeof(Range);' % (name, name))
    return '\n'.join(lines)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == '--check':
        sys.exit(0 if check(sys.argv[2]) else 1)
    control, strip, punct, folds = [], [], [], []
    for c in code_points():
        if is_control(c):
            control.append(c)
            continue
        if is_punct(c):
            punct.append(c)
        if in_ranges(c, WHITESPACE) or HANGUL[0] <= c <= HANGUL[1]:
            continue
        f = fold(c)
        if f == '':
            strip.append(c)
        elif f != chr(c):
            folds.append((c, f))
    pool, entries, row = [], [], []
    for c, f in folds:
        assert len(f) < 256 and len(pool) < 65536
        entries.append('{0x%X, %d, %d}' % (c, len(pool), len(f)))
        pool.extend(ord(ch) for ch in f)
    out = ['// GENERATED by scripts/gen_unicode_tables.py from Python unicodedata %s (plus the overrides'
           % ud.unidata_version,
           '// there that match Hugging Face tokenizers). Do not edit: rerun the script.',
           '// Tables only (declared in data/unicode_tables.h); lookups and the tokenizer are in',
           '// data/wordpiece.cpp.',
           '#include "data/unicode_tables.h"', '', 'namespace polytrain::unicode_tables {', '',
           emit_ranges('kControl', to_ranges(control),
                       'Removed by clean_text: NUL, U+FFFD, Cc Cf Co Cs except \\t \\n \\r.'), '',
           emit_ranges('kWhitespace', WHITESPACE, 'Rust char::is_whitespace: become " ".'), '',
           emit_ranges('kCjk', sorted(CJK), 'CJK ideographs: split into their own words.'), '',
           emit_ranges('kStripped', to_ranges(strip),
                       'Removed by accent stripping: non-spacing marks (and what decomposes to them).'), '',
           emit_ranges('kPunctuation', to_ranges(punct),
                       'BertPreTokenizer punctuation: ASCII punctuation and Unicode P*.'), '',
           '// Code point -> NFD without non-spacing marks, lowercased (Hangul syllables excepted).',
           'const Fold kFolds[] = {']
    for i in range(0, len(entries), 5):
        out.append('    ' + ', '.join(entries[i:i + 5]) + ',')
    out += ['};', 'const size_t kFoldsSize = sizeof(kFolds) / sizeof(Fold);', '',
            'const char32_t kFoldPool[] = {']
    for i in range(0, len(pool), 10):
        out.append('    ' + ', '.join('0x%X' % c for c in pool[i:i + 10]) + ',')
    out += ['};', '', '}  // namespace polytrain::unicode_tables', '']
    sys.stdout.write('\n'.join(out))


if __name__ == '__main__':
    main()
