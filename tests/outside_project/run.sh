#!/usr/bin/env bash
# ctest driver: install polytrain from BUILD_DIR into a temp prefix, build the outside project
# against it with find_package(polytrain), and train 5 steps; then again as a FlagAI user runs
# a self-launching Trainer: the program alone, asking for 2 processes, `launch` found on PATH.
set -euo pipefail
BUILD_DIR="$1"; SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD_DIR" --prefix "$WORK/prefix" >/dev/null
cmake -S "$SRC_DIR" -B "$WORK/build" -DCMAKE_PREFIX_PATH="$WORK/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/build" -j 2 >/dev/null
"$WORK/build/my_trainer" "$WORK/experiments"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(PATH="$WORK/prefix/bin:$PATH" "$WORK/build/my_trainer" "$WORK/experiments2" self_launch "$port" 2>&1) || { echo "$out"; exit 1; }
echo "$out"
grep -q "no launcher started this one: $WORK/prefix/bin/launch --num_gpus 2 --master_port $port -- " <<<"$out"
grep -q "^\[rank 0\] outside project trained 5 steps" <<<"$out"
grep -q "^\[rank 1\] outside project trained 5 steps" <<<"$out"
