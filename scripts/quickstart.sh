#!/usr/bin/env bash
# README command 1: set up (packages, assets, build), then the main job: a tiny BERT masked-LM
# trained data-parallel (env_type pytorchDDP, 2 processes over Gloo, started by `launch`) on
# the real corpus (Moby Dick + Sherlock Holmes) for a few hundred steps on CPU.
# Extra arguments go to train_bert (e.g. --max_steps 50).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Only what the main job needs (library, launch, train_bert): the test command builds the rest.
TARGETS="launch train_bert" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
BUILD="${BUILD_DIR:-$ROOT/build}"
exec "$BUILD/launch" --num_gpus 2 "$BUILD/train_bert" --config configs/bert_tiny_ddp.json "$@"
