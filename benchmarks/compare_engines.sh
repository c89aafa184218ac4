#!/usr/bin/env bash
# yaie against vLLM's CPU build and llama.cpp's llama-server, one after the other, same load.
#
# Usage:   benchmarks/compare_engines.sh            (peers installed by benchmarks/peers/install_*.sh)
# Env:     OUT (default benchmarks/results/compare)  CONC (default 1,8,32)  N (requests per level, 32)
#          MAX_TOKENS (128)  ENGINES (default "yaie llamacpp vllm")  DENSE (the dense HF copy for vLLM)
# Each engine serves the bundled SmolLM2-135M-Instruct on loopback: yaie and vLLM in fp32 (the
# GGUF's Q4_1 weights dequantized), llama.cpp on the Q4_1 GGUF itself. For each engine it runs the
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
DENSE=${DENSE:-$HOME/.cache/yaie/dense/SmolLM2-135M-Instruct}
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
mkdir -p "$OUT" "$PEERS_DIR"

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
    case $engine in
    yaie)
        python -m yaie.cli serve --port 8000 --log-level warning > "$PEERS_DIR/yaie-8000.log" 2>&1 &
        echo $! > "$PEERS_DIR/yaie-8000.pid"
        # shellcheck source=peers/_wait_ready.sh
        source benchmarks/peers/_wait_ready.sh
        wait_ready "$(cat "$PEERS_DIR/yaie-8000.pid")" http://127.0.0.1:8000/health 300 "$PEERS_DIR/yaie-8000.log"
        run_sets yaie http://127.0.0.1:8000
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/yaie-8000.pid"
        ;;
    llamacpp)
        # -kvu: one KV pool for all 8 slots, so 1,000-token prompts fit (8 slots x 1,024 otherwise).
        benchmarks/peers/start_llamacpp.sh 8080 -kvu > /dev/null
        run_sets llama.cpp http://127.0.0.1:8080
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/llamacpp-8080.pid"
        ;;
    vllm)
        python benchmarks/dense_copy.py --out "$DENSE"
        benchmarks/peers/start_vllm.sh 8092 "$DENSE" > /dev/null
        run_sets vllm-cpu http://127.0.0.1:8092
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/vllm-8092.pid"
        ;;
    *)
        echo "unknown engine $engine" >&2
        exit 2
        ;;
    esac
done
python benchmarks/compare_report.py "$OUT"
