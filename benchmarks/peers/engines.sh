# shellcheck shell=bash
# Sourced by compare_engines.sh and compare_context.sh: start and stop each engine we compare.
# start_engine NAME sets LABEL and URL for the running server; stop_engine NAME stops it.
# NAME is yaie, llamacpp or vllm. Every server serves the bundled SmolLM2-135M-Instruct on
# loopback: yaie on the GGUF in its default quantization (the Q4_1 weights as stored;
# YAIE_QUANTIZATION=none dequantizes them to fp32), vLLM in fp32 from the dense copy, llama.cpp
# on the GGUF.
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
    yaie)
        python -m yaie.cli serve --port 8000 --log-level warning > "$PEERS_DIR/yaie-8000.log" 2>&1 &
        echo $! > "$PEERS_DIR/yaie-8000.pid"
        wait_ready "$(cat "$PEERS_DIR/yaie-8000.pid")" http://127.0.0.1:8000/health 300 "$PEERS_DIR/yaie-8000.log"
        LABEL=yaie URL=http://127.0.0.1:8000
        ;;
    llamacpp)
        # -kvu: one KV pool for all 8 slots, so long prompts fit (8 slots x 1,024 tokens otherwise).
        "$PEERS/start_llamacpp.sh" 8080 -kvu > /dev/null
        LABEL=llama.cpp URL=http://127.0.0.1:8080
        ;;
    vllm)
        python "$PEERS/../dense_copy.py" --out "$DENSE"
        "$PEERS/start_vllm.sh" 8092 "$DENSE" --max-model-len 8192 > /dev/null
        LABEL=vllm-cpu URL=http://127.0.0.1:8092
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
    yaie) port=yaie-8000 ;;
    llamacpp) port=llamacpp-8080 ;;
    vllm) port=vllm-8092 ;;
    esac
    "$PEERS/stop_peer.sh" "$PEERS_DIR/$port.pid"
}
