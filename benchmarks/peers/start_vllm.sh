#!/usr/bin/env bash
# Start vLLM's CPU build (OpenAI API server) on 127.0.0.1 and wait until it is ready (~80 s).
#
# Usage:   benchmarks/peers/start_vllm.sh PORT MODEL_DIR [extra api_server args...]
#          MODEL_DIR is a dense Hugging Face checkpoint (e.g. from benchmarks/dense_copy.py --out DIR).
#          The served model name is MODEL_DIR as given (pass --served-model-name NAME to change it).
# Env:     PEERS_DIR (default /tmp/peers)   VLLM_VENV (default $PEERS_DIR/vllm-venv)
#          VLLM_CPU_KVCACHE_SPACE GiB (default 4)   VLLM_CPU_OMP_THREADS_BIND (default 0-1: both cores;
#          without it vLLM computes on one core)   READY_TIMEOUT_S (default 600)
# Defaults: --dtype float32 --max-model-len 4096 (the comparison is fp32 against fp32).
# The `vllm` console script of vllm-cpu is broken, so the server is started as a module.
# Writes:  $PEERS_DIR/vllm-PORT.pid and $PEERS_DIR/vllm-PORT.log; prints the PID on stdout.
# Stop it: benchmarks/peers/stop_peer.sh $PEERS_DIR/vllm-PORT.pid
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_wait_ready.sh
source "$(dirname "$0")/_wait_ready.sh"

if [[ $# -lt 2 ]]; then
    sed -n '2,/^set /{/^#/p}' "$0" >&2
    exit 2
fi
PORT=$1
MODEL_DIR=$2
shift 2
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
VLLM_VENV=${VLLM_VENV:-$PEERS_DIR/vllm-venv}
PIDFILE="$PEERS_DIR/vllm-$PORT.pid"
LOG="$PEERS_DIR/vllm-$PORT.log"

if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    echo "no venv at $VLLM_VENV; run benchmarks/peers/install_vllm.sh" >&2
    exit 1
fi
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    echo "$MODEL_DIR has no config.json; make a dense copy first (benchmarks/dense_copy.py --out DIR)" >&2
    exit 1
fi
if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "already running: pid $(cat "$PIDFILE") ($PIDFILE)" >&2
    exit 1
fi

mkdir -p "$PEERS_DIR"
HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} \
    LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" \
    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --dtype float32 --max-model-len 4096 "$@" > "$LOG" 2>&1 &
pid=$!
echo "$pid" > "$PIDFILE"
if ! wait_ready "$pid" "http://127.0.0.1:$PORT/v1/models" "${READY_TIMEOUT_S:-600}" "$LOG"; then
    kill "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
    exit 1
fi
echo "$pid"
