#!/usr/bin/env bash
# yaie against vLLM's CPU build and llama.cpp's llama-server, one after the other, same load.
#
# Usage:   benchmarks/compare_engines.sh            (peers installed by benchmarks/peers/install_*.sh)
# Env:     OUT (default benchmarks/results/compare)  CONC (default 1,8,32)  N (requests per level, 32)
#          MAX_TOKENS (128)  ENGINES (default "yaie llamacpp vllm")  DENSE (the dense HF copy for vLLM)
# Each engine serves the bundled SmolLM2-135M-Instruct on loopback: yaie on the GGUF in its default
# quantization (the Q4_1 weights as stored; YAIE_QUANTIZATION=none dequantizes them to fp32), vLLM
# in fp32 from the dense copy, llama.cpp on the Q4_1 GGUF itself. For each engine it runs the
# short-prompt set at every concurrency level, then the shared-prefix set (a 1,000-token system
# prompt + 16 questions, one at a time, after one warm-up request), then stops the server.
# Afterwards benchmarks/compare_report.py prints the table of ratios and draws the plots.
# Run it on an idle machine: these 2-core machines are noisy and a busy neighbour halves any figure.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/compare}
CONC=${CONC:-1,8,32}
N=${N:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
ENGINES=${ENGINES:-yaie llamacpp vllm}
mkdir -p "$OUT"
# shellcheck source=peers/engines.sh
source benchmarks/peers/engines.sh

run_sets() {  # LABEL BASE_URL [serve_bench args...]
    local label=$1 url=$2
    shift 2
    python benchmarks/serve_bench.py --base-url "$url" --label "$label" --prompt-set short \
        --concurrency "$CONC" --num-requests "$N" --max-tokens "$MAX_TOKENS" --ignore-eos \
        --out "$OUT/$label-short.json" "$@"
    python benchmarks/serve_bench.py --base-url "$url" --label "$label" --prompt-set shared-prefix \
        --concurrency 1 --num-requests 16 --max-tokens 32 --ignore-eos \
        --out "$OUT/$label-shared-prefix.json" "$@"
}

for engine in $ENGINES; do
    start_engine "$engine"
    run_sets "$LABEL" "$URL"
    stop_engine "$engine"
done
python benchmarks/compare_report.py "$OUT"
