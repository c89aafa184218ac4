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
mkdir -p "$OUT"
# shellcheck source=peers/engines.sh
source benchmarks/peers/engines.sh

sweep() {  # LABEL BASE_URL
    for context in $CONTEXTS; do
        python benchmarks/serve_bench.py --base-url "$2" --label "$1" --prompt-set long \
            --long-prompt-tokens "$context" --concurrency 1 --num-requests 3 --max-tokens 64 \
            --ignore-eos --out "$OUT/$1-ctx$context.json"
    done
}

for engine in $ENGINES; do
    start_engine "$engine"
    sweep "$LABEL" "$URL"
    stop_engine "$engine"
done
python benchmarks/compare_report.py "$OUT"
