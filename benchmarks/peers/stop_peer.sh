#!/usr/bin/env bash
# Stop a server started by start_llamacpp.sh / start_vllm.sh, by the PID in its pid file.
#
# Usage:   benchmarks/peers/stop_peer.sh PIDFILE [GRACE_S]
# Sends SIGTERM to that PID, waits up to GRACE_S (default 20) seconds, then SIGKILL; removes PIDFILE.
# vLLM's api_server runs its engine and worker in child processes (server -> EngineCore -> Worker);
# SIGTERM to the server shuts them down too, and any descendant still alive after the grace period
# is killed by its PID as well.
# Idempotent: a missing pid file or an already-dead PID is not an error.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,/^set /{/^#/p}' "$0" >&2
    exit 2
fi
PIDFILE=$1
GRACE_S=${2:-20}
if [[ ! -f "$PIDFILE" ]]; then
    echo "no pid file $PIDFILE: nothing to stop" >&2
    exit 0
fi
pid=$(cat "$PIDFILE")
if ! kill -0 "$pid" 2>/dev/null; then
    echo "pid $pid is not running" >&2
    rm -f "$PIDFILE"
    exit 0
fi

descendants() {
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child"
        descendants "$child"
    done
}

children=$(descendants "$pid")
kill -TERM "$pid"
for ((i = 0; i < GRACE_S * 4; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
done
if kill -0 "$pid" 2>/dev/null; then
    echo "pid $pid ignored SIGTERM for ${GRACE_S}s; sending SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
fi
for child in $children; do
    if kill -0 "$child" 2>/dev/null; then
        echo "killing leftover process $child" >&2
        kill -KILL "$child" 2>/dev/null || true
    fi
done
rm -f "$PIDFILE"
echo "stopped $pid" >&2
