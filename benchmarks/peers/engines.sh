# shellcheck shell=bash
# Sourced by compare_engines.sh and compare_context.sh: start and stop each engine we compare.
# start_engine NAME sets LABEL and URL for the running server; stop_engine NAME stops it.
# NAME is one of
#   yaie        yaie as `yaie serve` runs it by default
#   yaie-fp32   yaie with --quantization none: the GGUF's Q4_1 weights dequantized to fp32
#   llamacpp    llama.cpp's llama-server on the GGUF itself, 8 slots
#   llamacpp-np1  the same with one slot: llama.cpp's best for one client
#   ik, ik-np1  ik_llama.cpp's llama-server (benchmarks/peers/install_ik_llamacpp.sh), 8 slots or
#               one, with its run-time repacking (-rtr), its fastest decode
#   vllm        vLLM's CPU build in fp32, on a dense copy of the GGUF (dequantized)
#   vllm-bf16   the same in bf16: vLLM's fastest setting on CPUs with native bf16 (AVX512-BF16)
# Every server serves $MODEL (default: the bundled SmolLM2-135M-Instruct) on loopback; the vLLM
# engines only the bundled model (they read its dense copy).
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
        [[ -n ${MODEL:-} ]] && flags+=("$MODEL")
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
    llamacpp-np1)
        "$PEERS/start_llamacpp.sh" 8080 -np 1 > /dev/null
        LABEL=llama.cpp-np1 URL=http://127.0.0.1:8080
        ;;
    ik | ik-np1)
        local slots=8 label=ik_llama.cpp
        [[ $1 == ik-np1 ]] && slots=1 label=ik_llama.cpp-np1
        # Its own command line: ik's server knows neither --no-webui nor -kvu, so each of the 8
        # slots gets 2,048 tokens of a 16,384-token context instead.
        local model=${MODEL:-$(python -c "from yaie.model.loader import bundled_model_path; print(bundled_model_path())")}
        "$PEERS_DIR/ik_llama.cpp/build/bin/llama-server" -m "$model" --host 127.0.0.1 --port 8080 -t 2 -tb 2 \
            -c $((slots * 2048)) -np "$slots" -cb -rtr > "$PEERS_DIR/llamacpp-8080.log" 2>&1 &
        echo $! > "$PEERS_DIR/llamacpp-8080.pid"
        wait_ready "$(cat "$PEERS_DIR/llamacpp-8080.pid")" http://127.0.0.1:8080/health 300 "$PEERS_DIR/llamacpp-8080.log"
        LABEL=$label URL=http://127.0.0.1:8080
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
    llamacpp | llamacpp-np1 | ik | ik-np1) port=llamacpp-8080 ;;
    vllm | vllm-bf16) port=vllm-8092 ;;
    esac
    "$PEERS/stop_peer.sh" "$PEERS_DIR/$port.pid"
}
