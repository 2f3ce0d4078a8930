# Shell functions the benchmark scripts share; source it after setting MODEL, PORT, PYTHON and
# RESULTS_DIR. `start_server LABEL [zllm serve options...]` starts `zllm serve MODEL` on
# 127.0.0.1:PORT with its log in RESULTS_DIR/server-LABEL.log and returns once /health
# answers (1 on an exit or after 600 s); `stop_server` sends it SIGTERM and waits. The
# sourcing script's EXIT trap stops a server left running.

server_pid=""

stop_server() {
    if [ -n "$server_pid" ]; then
        kill -TERM "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap stop_server EXIT

start_server() {  # $1: label, then zllm serve options
    local label="$1"
    shift
    "$PYTHON" -m zllm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" "$@" \
        >"$RESULTS_DIR/server-$label.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 600); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
        if ! kill -0 "$server_pid" 2>/dev/null; then
            tail -20 "$RESULTS_DIR/server-$label.log" >&2
            return 1
        fi
        sleep 1
    done
    echo "server $label did not start" >&2
    return 1
}
