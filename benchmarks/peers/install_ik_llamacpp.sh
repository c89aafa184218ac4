#!/usr/bin/env bash
# Build ik_llama.cpp's `llama-bench` and `llama-server` (ikawrakow's fork of llama.cpp, the fastest
# CPU engine we have measured: ../shared/peers/README.md) for benchmarking yaie against it.
#
# Its source is not on PyPI: bring a checkout of github.com/ikawrakow/ik_llama.cpp (a clone, or a
# snapshot's work tree) and name it. Nothing lands in the repository.
#
# Usage:   IK_SRC=/path/to/ik_llama.cpp benchmarks/peers/install_ik_llamacpp.sh
# Env:     IK_SRC      the checkout (required)
#          PEERS_DIR   where the link goes                      (default /tmp/peers)
#          JOBS        parallel compile jobs                    (default 2)
# Result:  $PEERS_DIR/ik_llama.cpp/build/bin/llama-bench and .../llama-server
# The build takes ~10 min on 2 cores.
set -euo pipefail

: "${IK_SRC:?name a checkout of ik_llama.cpp in IK_SRC}"
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
JOBS=${JOBS:-2}
LINK="$PEERS_DIR/ik_llama.cpp"
mkdir -p "$PEERS_DIR"
ln -sfn "$(cd "$IK_SRC" && pwd)" "$LINK"
start=$(date +%s)

cd "$IK_SRC"
cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build build -j"$JOBS" --target llama-bench llama-server
echo "[install_ik_llamacpp] done in $(($(date +%s) - start)) s: $LINK/build/bin/llama-bench"
