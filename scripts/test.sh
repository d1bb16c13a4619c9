#!/usr/bin/env bash
# README command 2: set up (packages, assets, build), then the whole GoogleTest suite via ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "${BUILD_DIR:-$ROOT/build}"
ctest --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 600 "$@"
