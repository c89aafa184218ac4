#!/usr/bin/env bash
# Start llama.cpp's native llama-server on 127.0.0.1 and wait until it is ready.
#
# Usage:   benchmarks/peers/start_llamacpp.sh PORT [extra llama-server args...]
#          e.g. start_llamacpp.sh 8080                      (our defaults, below)
#               start_llamacpp.sh 8080 -np 32 -c 16384      (later args override earlier ones)
# Env:     PEERS_DIR  (default /tmp/peers)   LLAMA_SERVER (default $PEERS_DIR/llama.cpp/build/bin/llama-server)
#          MODEL      GGUF to serve (default: the GGUF bundled with yaie)
#          READY_TIMEOUT_S (default 120)
# Defaults: -t 2 -tb 2 -c 8192 -np 8 -cb --no-webui: the 8 slots split the context, 1,024 tokens each.
#          For serve_bench's long / shared-prefix sets (~1,150-token prompts) add -kvu (one KV pool
#          shared by all slots), or requests fail with HTTP 400 "exceeds the available context size".
# Writes:  $PEERS_DIR/llamacpp-PORT.pid and $PEERS_DIR/llamacpp-PORT.log; prints the PID on stdout.
# Stop it: benchmarks/peers/stop_peer.sh $PEERS_DIR/llamacpp-PORT.pid
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_wait_ready.sh
source "$(dirname "$0")/_wait_ready.sh"

if [[ $# -lt 1 ]]; then
    sed -n '2,/^set /{/^#/p}' "$0" >&2
    exit 2
fi
PORT=$1
shift
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
LLAMA_SERVER=${LLAMA_SERVER:-$PEERS_DIR/llama.cpp/build/bin/llama-server}
MODEL=${MODEL:-$(python -c "from yaie.model.loader import bundled_model_path; print(bundled_model_path())")}
PIDFILE="$PEERS_DIR/llamacpp-$PORT.pid"
LOG="$PEERS_DIR/llamacpp-$PORT.log"

if [[ ! -x "$LLAMA_SERVER" ]]; then
    echo "no llama-server at $LLAMA_SERVER; run benchmarks/peers/install_llamacpp.sh" >&2
    exit 1
fi
if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "already running: pid $(cat "$PIDFILE") ($PIDFILE)" >&2
    exit 1
fi

mkdir -p "$PEERS_DIR"
"$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
    -t 2 -tb 2 -c 8192 -np 8 -cb --no-webui "$@" > "$LOG" 2>&1 &
pid=$!
echo "$pid" > "$PIDFILE"
if ! wait_ready "$pid" "http://127.0.0.1:$PORT/health" "${READY_TIMEOUT_S:-120}" "$LOG"; then
    kill "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
    exit 1
fi
echo "$pid"
