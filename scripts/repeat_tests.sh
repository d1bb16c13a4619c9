#!/usr/bin/env bash
# Runs the launcher / DDP multi-process tests N times in a row under `ctest -j 2` (default 20) in
# an already built tree, stopping at the first failure; prints each pass's time. The flake hunt
# of issue 14: these tests start thousands of processes and signal them by pid.
# Usage: scripts/repeat_tests.sh [N] [BUILD_DIR]        (default 20, build)
# Left out: the model, tokenizer and hivemind tests (their own binaries), and
# Fixture.DataParallelReproducesSingleProcessTraining (288 s alone; run it on its own).
set -euo pipefail
N="${1:-20}"
BUILD="${2:-build}"
cd "$BUILD"
EX='NOT_BUILT|^Family|Safetensors|^Gpt2|^T5|^Albert|^Hf|^Config|^Dht|^Record|^Butterfly|^StateDownload'
EX+='|^Matchmaking|^Progress|^Compression|^Wire|^Metrics|^Swarm|outside_project|CheckpointMarker|SampleStream'
EX+='|Table/Filter|Fixture.DataParallelReproducesSingleProcessTraining'
# Only the binaries of this set need to exist; anything else is excluded above.
echo "repeat: $(ctest -N -E "$EX" | tail -1 | tr -d '\n') x $N under ctest -j 2"
for i in $(seq 1 "$N"); do
  start=$(date +%s)
  log="Testing/repeat_pass_$i.log"
  if ctest -j2 -E "$EX" >"$log" 2>&1; then
    echo "pass $i: $(grep -o '[0-9]* tests failed out of [0-9]*' "$log") in $(( $(date +%s) - start )) s"
  else
    echo "pass $i FAILED ($log):"; grep -E '\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)' "$log" || tail -20 "$log"
    exit 1
  fi
done
echo "repeat: $N passes in a row, no failure"
