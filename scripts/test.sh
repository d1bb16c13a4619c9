#!/usr/bin/env bash
# README command 2: set up (packages, assets, build), then the whole GoogleTest suite via ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "${BUILD_DIR:-$ROOT/build}"
# A test whose tool, package or asset is missing fails, naming it, instead of skipping (only the
# tests that need a GPU still skip): setup.sh installs all of them, so a skip means it missed one.
# POLYTRAIN_REQUIRE_ALL=0 from the caller turns skipping back on.
export POLYTRAIN_REQUIRE_ALL="${POLYTRAIN_REQUIRE_ALL:-1}"
rc=0
ctest --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 600 "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
  # Parallel runs interleave output; print each failed test's own output once more at the
  # end so the reason is in the last lines of a CI log.
  echo "==== output of the failed tests (from this run's log) ===="
  log=Testing/Temporary/LastTest.log
  while IFS= read -r t; do
    awk -v t="$t" '/^[0-9]+\/[0-9]+ Testing: / {on = (substr($0, index($0, ": ") + 2) == t)} on' "$log" | tail -60
  done < <(cut -d: -f2- Testing/Temporary/LastTestsFailed.log 2>/dev/null)
fi
exit "$rc"
