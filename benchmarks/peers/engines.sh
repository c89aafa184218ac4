# shellcheck shell=bash
# Sourced by compare_engines.sh and compare_context.sh: start and stop each engine we compare.
# start_engine NAME sets LABEL and URL for the running server; stop_engine NAME stops it.
# NAME is one of
#   yaie        yaie as `yaie serve` runs it by default
#   yaie-fp32   yaie with --quantization none: the GGUF's Q4_1 weights dequantized to fp32
#   llamacpp    llama.cpp's llama-server on the Q4_1 GGUF itself
#   vllm        vLLM's CPU build in fp32, on a dense copy of the GGUF (dequantized)
#   vllm-bf16   the same in bf16: vLLM's fastest setting on CPUs with native bf16 (AVX512-BF16)
# Every server serves the bundled SmolLM2-135M-Instruct on loopback.
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
# LABEL and URL are read by the scripts that source this file.
# shellcheck disable=SC2034
DENSE=${DENSE:-$HOME/.cache/yaie/dense/SmolLM2-135M-Instruct}
PEERS=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=_wait_ready.sh
source "$PEERS/_wait_ready.sh"

start_engine() {
    mkdir -p "$PEERS_DIR"
    case $1 in
    yaie | yaie-fp32)
        local flags=()
        [[ $1 == yaie-fp32 ]] && flags=(--quantization none)
        python -m yaie.cli serve --port 8000 --log-level warning "${flags[@]}" > "$PEERS_DIR/yaie-8000.log" 2>&1 &
        echo $! > "$PEERS_DIR/yaie-8000.pid"
        wait_ready "$(cat "$PEERS_DIR/yaie-8000.pid")" http://127.0.0.1:8000/health 300 "$PEERS_DIR/yaie-8000.log"
        LABEL=$1 URL=http://127.0.0.1:8000
        ;;
    llamacpp)
        # -kvu: one KV pool for all 8 slots, so long prompts fit (8 slots x 1,024 tokens otherwise).
        "$PEERS/start_llamacpp.sh" 8080 -kvu > /dev/null
        LABEL=llama.cpp URL=http://127.0.0.1:8080
        ;;
    vllm | vllm-bf16)
        python "$PEERS/../dense_copy.py" --out "$DENSE"
        local dtype=float32 label=vllm-cpu-fp32
        [[ $1 == vllm-bf16 ]] && dtype=bfloat16 label=vllm-cpu-bf16
        "$PEERS/start_vllm.sh" 8092 "$DENSE" --max-model-len 8192 --dtype "$dtype" > /dev/null
        LABEL=$label URL=http://127.0.0.1:8092
        ;;
    *)
        echo "unknown engine $1" >&2
        return 2
        ;;
    esac
}

stop_engine() {
    local port
    case $1 in
    yaie | yaie-fp32) port=yaie-8000 ;;
    llamacpp) port=llamacpp-8080 ;;
    vllm | vllm-bf16) port=vllm-8092 ;;
    esac
    "$PEERS/stop_peer.sh" "$PEERS_DIR/$port.pid"
}
