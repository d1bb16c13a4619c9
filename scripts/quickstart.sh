#!/usr/bin/env bash
# README command 1: set up (packages, assets, build), then the main job: train_bert on the real
# corpus (Moby Dick + Sherlock Holmes) for a few hundred steps on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${BUILD_DIR:-$ROOT/build}/train_bert" --config configs/bert_tiny.json "$@"
