#!/usr/bin/env bash
# ctest driver: install polytrain from BUILD_DIR into a temp prefix, build the outside project
# against it with find_package(polytrain), and train 5 steps.
set -euo pipefail
BUILD_DIR="$1"; SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD_DIR" --prefix "$WORK/prefix" >/dev/null
cmake -S "$SRC_DIR" -B "$WORK/build" -DCMAKE_PREFIX_PATH="$WORK/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/build" -j 2 >/dev/null
"$WORK/build/my_trainer" "$WORK/experiments"
