# shellcheck shell=bash
# Sourced by the start_*.sh scripts: wait for a freshly started server to answer HTTP.
# wait_ready PID URL TIMEOUT_S LOG: polls URL until it returns 200; fails if PID dies or time runs out.
wait_ready() {
    local pid=$1 url=$2 timeout_s=$3 log=$4 waited=0
    until curl -sf -o /dev/null --max-time 2 "$url"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "server (pid $pid) exited during startup; last lines of $log:" >&2
            tail -n 30 "$log" >&2
            return 1
        fi
        if ((waited >= timeout_s)); then
            echo "server (pid $pid) not ready at $url after ${timeout_s}s; see $log" >&2
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "ready after ~${waited}s: $url" >&2
}
