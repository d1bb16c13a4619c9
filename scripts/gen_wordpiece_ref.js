#!/usr/bin/env node
// Reference data for tests/test_wordpiece.cpp: picks the test lines (corpus + hard cases) and
// encodes them with Hugging Face's own BERT WordPiece tokenizer (npm `tokenizers`, the Rust
// library with prebuilt binaries), cross-checked with the JS port `@huggingface/tokenizers`.
// The C++ test reads only the committed outputs; npm is needed only to regenerate them.
//
//   node scripts/gen_wordpiece_ref.js cases            -> tests/data/wordpiece_cases.txt
//   node scripts/gen_wordpiece_ref.js ref              -> tests/data/wordpiece_ref.txt
//   node scripts/gen_wordpiece_ref.js unicode-probe F  -> F, for gen_unicode_tables.py --check
// Assets come from scripts/fetch_assets.sh ($POLYTRAIN_CACHE or .cache/assets); the npm
// packages are installed on first use into .cache/npm (git-ignored).
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

const REPO = path.resolve(__dirname, '..');
const CACHE = process.env.POLYTRAIN_CACHE || path.join(REPO, '.cache', 'assets');
const VOCAB = path.join(CACHE, 'vocab', 'bert-base-uncased-vocab.txt');
const CASES = path.join(REPO, 'tests', 'data', 'wordpiece_cases.txt');
const REF = path.join(REPO, 'tests', 'data', 'wordpiece_ref.txt');
const NPM_DIR = path.join(REPO, '.cache', 'npm');
const PACKAGES = ['tokenizers@0.23.2', '@huggingface/tokenizers@0.2.0'];
const CORPUS_LINES_PER_BOOK = 150;

function need(name) {
  const dir = path.join(NPM_DIR, 'node_modules', name);
  if (!fs.existsSync(dir)) {
    execFileSync('npm', ['install', '--no-save', '--loglevel=error', '--prefix', NPM_DIR, ...PACKAGES],
                 { stdio: 'inherit' });
  }
  return require(dir);
}

// Hand-written hard cases (no NUL, CR or LF: one case per line of the file).
const HARD_CASES = [
  // accents and other Latin letters
  'café', 'naïve', 'Ångström', 'résumé', 'Crème brûlée à la carte', 'ÀÉÎÕÜ àéîõü ÇÑ çñ',
  'cafe\u0301 with a combining acute', 'a\u0308\u0304 two marks', 'Z\u0324\u0308\u036b zalgo',
  'Straße', 'İstanbul ı', 'Tiếng Việt có dấu', 'Zażółć gęślą jaźń', 'Ørsted Œuvre Æsir ð þ',
  'ǅemal ǈudevit', 'ﬁnance ﬂow', 'K Kelvin sign, Å angstrom sign, Ω ohm sign', 'Ⅻ ㎏ ½ ¾ ² ³',
  '𝐇𝐞𝐥𝐥𝐨 mathematical bold', 'ｆｕｌｌｗｉｄｔｈ ＡＢＣ　１２３！',
  // other scripts
  'ΣΊΣΥΦΟΣ Σίσυφος', 'Москва Київ Ёлка', 'مرحبا بالعالم', 'שָׁלוֹם עוֹלָם', 'हिन्दी भाषा', 'ไทย ภาษา',
  // CJK and Hangul
  '中文字符', '日本語のテキスト', '我爱北京天安门。', '한국어 텍스트', '豈 更 compatibility ideographs',
  'mixed中文and English', '𠀀𠀁 extension B',
  // punctuation
  '!!!???...', '"quoted"', "'single' quotes", '(parens) [brackets] {braces}', 'a--b---c',
  '“smart quotes” and ‘apostrophes’', 'em—dash – en-dash', '…ellipsis…', '¿Qué? ¡Olé!',
  '100% of $5.00 @ #1 & ^_^ ~tilde~ `backtick` |pipe| \\backslash/', '§ ¶ • † ‡ · «guillemets»',
  '<html> a+b=c </html>', 'e-mail: someone@example.org', 'https://www.example.org/a_b?c=d&e=f#g',
  '...', '.',
  // long words (max_input_chars_per_word = 100, counted after normalization)
  'a'.repeat(120), 'short ' + 'b'.repeat(100) + ' end', 'short ' + 'c'.repeat(101) + ' end',
  'e\u0301'.repeat(60), 'supercalifragilisticexpialidocious antidisestablishmentarianism',
  'pneumonoultramicroscopicsilicovolcanoconiosis', 'x'.repeat(40) + 'qz'.repeat(30),
  // special tokens written in the text
  'the [MASK] is', '[CLS] hello [SEP] world [SEP]', '[mask] in lower case', '[MASK][MASK]',
  'a[MASK]b', '[PAD] [UNK] [unused0]', '[ MASK ]', '[MASK', '[[MASK]]', 'Paris is the [MASK] of France.',
  // tabs, control and format characters, odd whitespace
  'tab\tseparated\tvalues', '\t leading and trailing \t', 'bell\u0007char', 'zero\u200bwidth space',
  'soft\u00adhyphen', 'bom\ufeffinside', 'vertical\u000btab form\u000cfeed', 'del\u007fete',
  'c1\u0085next line', 'line\u2028separator', 'replacement \ufffd char', '\u0001\u0002\u0003 start',
  'nbsp\u00a0here', 'ideographic\u3000space', 'private\ue000use', 'left\u200eto\u200fright', '   \t  ',
  // emoji and symbols
  'I ❤️ emoji 😀👍🏽🎉', 'family 👨‍👩‍👧', 'flag 🇫🇷', '🥰 newer emoji', '☃ ☺ ★ ♥ © ® ™',
  // numbers
  '3.14159 2,718 1e-10 0x1F 1/2 42nd 1st', 'Call 555-1234 on 2023-01-15 at 10:30am',
  '¥100 €50 £20 ₹30', '١٢٣ ٤٥٦', '123456789012345678901234567890',
  // hyphens, apostrophes, case
  'well-known state-of-the-art mother-in-law', 're-enter co-operate', 'ALL CAPS SENTENCE',
  'CamelCaseWord', "iPhone McDonald's O'Brien don't won't I'm", 'unaffable unbelievably',
  'The quick brown fox jumps over the lazy dog.',
];

function corpus_lines(file, count) {
  let text = fs.readFileSync(file, 'utf8');
  const lines = text.split(/\r?\n/).filter((l) => l.trim() !== '');
  const picked = [];
  for (let i = 0; i < count; i++) picked.push(lines[Math.floor((i * lines.length) / count)]);
  return picked;
}

function make_cases() {
  const lines = [
    ...corpus_lines(path.join(CACHE, 'corpus', 'mobydick.txt'), CORPUS_LINES_PER_BOOK),
    ...corpus_lines(path.join(CACHE, 'corpus', 'sherlock.txt'), CORPUS_LINES_PER_BOOK),
    ...HARD_CASES,
  ];
  for (const l of lines) if (/[\0\r\n]/.test(l)) throw new Error('case holds NUL/CR/LF: ' + l);
  fs.mkdirSync(path.dirname(CASES), { recursive: true });
  fs.writeFileSync(CASES, lines.join('\n') + '\n');
  console.log(`wrote ${lines.length} cases to ${CASES}`);
}

// bert-base-uncased's tokenizer.json, built around the vocab.txt.
function tokenizer_json() {
  const tokens = fs.readFileSync(VOCAB, 'utf8').split('\n');
  if (tokens[tokens.length - 1] === '') tokens.pop();
  const vocab = {};
  tokens.forEach((t, i) => { vocab[t] = i; });
  const added_tokens = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'].map((t) => ({
    id: vocab[t], content: t, single_word: false, lstrip: false, rstrip: false, normalized: false,
    special: true }));
  return {
    version: '1.0', truncation: null, padding: null, added_tokens,
    normalizer: { type: 'BertNormalizer', clean_text: true, handle_chinese_chars: true,
                  strip_accents: null, lowercase: true },
    pre_tokenizer: { type: 'BertPreTokenizer' },
    post_processor: null,
    decoder: { type: 'WordPiece', prefix: '##', cleanup: true },
    model: { type: 'WordPiece', unk_token: '[UNK]', continuing_subword_prefix: '##',
             max_input_chars_per_word: 100, vocab },
  };
}

function read_cases() {
  const lines = fs.readFileSync(CASES, 'utf8').split('\n');
  if (lines[lines.length - 1] === '') lines.pop();
  return lines;
}

async function make_ref() {
  const json = tokenizer_json();
  const rust = need('tokenizers').Tokenizer.fromString(JSON.stringify(json));
  const { Tokenizer: JsTokenizer } = need('@huggingface/tokenizers');
  const js = new JsTokenizer(json, { do_lower_case: true, model_max_length: 1e9 });
  const out = [];
  let differ = 0;
  for (const line of read_cases()) {
    const ids = (await rust.encode(line, null, { addSpecialTokens: false })).getIds();
    const js_ids = js.encode(line, { add_special_tokens: false }).ids;
    if (ids.join(' ') !== js_ids.join(' ')) {
      if (++differ <= 10) console.error(`JS port differs on ${JSON.stringify(line)}`);
    }
    out.push(ids.join(' '));
  }
  fs.writeFileSync(REF, out.join('\n') + '\n');
  console.log(`wrote ${out.length} reference lines to ${REF} (tokenizers 0.23.2);` +
              ` @huggingface/tokenizers 0.2.0 agrees on ${out.length - differ}`);
}

// One line per code point that BertNormalizer changes or BertPreTokenizer splits:
// "<hex> <w|p|o> <normalized code points, comma-separated hex>" (w: whitespace, p: punctuation).
function unicode_probe(file) {
  const t = need('tokenizers');
  const norm = t.bertNormalizer({ cleanText: true, handleChineseChars: true, stripAccents: true,
                                  lowercase: true });
  const pre = t.bertPreTokenizer();
  const out = [];
  for (let cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xd800 && cp <= 0xdfff) continue;
    const s = String.fromCodePoint(cp);
    const n = norm.normalizeString(s);
    const parts = pre.preTokenizeString('a' + s + 'b').length;
    const cls = parts === 2 ? 'w' : parts === 3 ? 'p' : 'o';
    if (n !== s || cls !== 'o')
      out.push(`${cp.toString(16)} ${cls} ${[...n].map((c) => c.codePointAt(0).toString(16)).join(',')}`);
  }
  fs.writeFileSync(file, out.join('\n') + '\n');
  console.log(`wrote ${out.length} code points to ${file}`);
}

const [mode, arg] = process.argv.slice(2);
if (mode === 'cases') make_cases();
else if (mode === 'ref') make_ref().catch((e) => { console.error(`error: ${e.message}`); process.exit(1); });
else if (mode === 'unicode-probe' && arg) unicode_probe(arg);
else { console.error('usage: gen_wordpiece_ref.js cases | ref | unicode-probe FILE'); process.exit(2); }
