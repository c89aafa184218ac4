#!/usr/bin/env bash
# Build llama.cpp's native `llama-server`, `llama-bench`, `llama-quantize`, `llama-perplexity` and
# `llama-tokenize` for benchmarking yaie against it and making its GGUF files at real sizes.
#
# The PyPI sdist of llama-cpp-python==0.3.36 vendors a complete llama.cpp tree
# (vendor/llama.cpp), so the build needs only PyPI: download the sdist, unpack it, build with CMake.
# Nothing lands in the repository; everything goes under PEERS_DIR (default /tmp/peers).
#
# Usage:   benchmarks/peers/install_llamacpp.sh
# Env:     PEERS_DIR   where to put the download and the build   (default /tmp/peers)
#          JOBS        parallel compile jobs                      (default 2)
# Result:  $PEERS_DIR/llama.cpp/build/bin/llama-server and .../llama-bench
#          ($PEERS_DIR/llama.cpp is a symlink to the vendored tree.)
# Idempotent: re-running skips the download/unpack when present and lets CMake rebuild incrementally.
# The build takes ~15 min on 2 cores; on a shared machine run it as
#   nice -n 19 benchmarks/peers/install_llamacpp.sh > /tmp/peers/llamacpp-build.log 2>&1 &
set -euo pipefail

VERSION=0.3.36
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
JOBS=${JOBS:-2}
DL_DIR="$PEERS_DIR/llamacpp-dl"
SRC_DIR="$DL_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
LINK="$PEERS_DIR/llama.cpp"

mkdir -p "$DL_DIR"
start=$(date +%s)

sdist="$DL_DIR/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$sdist" ]]; then
    echo "[install_llamacpp] downloading llama-cpp-python==$VERSION sdist"
    # Only this package as source: with `--no-binary :all:` pip also builds its build tools
    # (CMake among them) from source just to read the metadata, which takes far longer than the build.
    python -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DL_DIR"
fi
if [[ ! -f "$SRC_DIR/CMakeLists.txt" ]]; then
    echo "[install_llamacpp] unpacking $sdist"
    tar -xzf "$sdist" -C "$DL_DIR"
fi
ln -sfn "$SRC_DIR" "$LINK"

cd "$SRC_DIR"
# On a CPU with AMX the native build segfaults in ggml_backend_amx_mul_mat on the first prompt
# (../shared/peers/README.md): build without AMX there; ggml's AVX-512 repacking stays on.
no_amx=()
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    no_amx=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
echo "[install_llamacpp] configuring in $SRC_DIR/build"
cmake -B build "${no_amx[@]}" \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=Release
echo "[install_llamacpp] building llama-server, llama-bench, llama-quantize, llama-perplexity and llama-tokenize with -j$JOBS"
cmake --build build -j"$JOBS" --target llama-server llama-bench llama-quantize llama-perplexity llama-tokenize

"$SRC_DIR/build/bin/llama-server" --version || true
echo "[install_llamacpp] done in $(($(date +%s) - start)) s: $LINK/build/bin/llama-server"
