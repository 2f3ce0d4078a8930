#!/usr/bin/env bash
# Concurrency 1 on a CPU shared with another program (issue 76, item 6): each server's TPOT
# alone, then beside a process spinning on one of the cores the server may use (pinned there
# with taskset), through the same client (`zllm bench serve`, random-token prompts).
#   zllm             the default: threads follow the cores others leave (executor/host/cpu_share.py)
#   zllm-fixed       ZLLM_CPU_SHARE=0: the threads it started with, whatever else runs
#   llama-server     llama.cpp's server, -t THREADS
# usage: benchmarks/shared_cpu.sh            (from the repository root)
# env:   MODEL [the 1B Q4_K_M from benchmarks/compare.sh's cache]  LLAMA_BIN [its AVX-512 build]
#        THREADS [every core]  PROMPTS [6]  INPUT [128]  OUTPUT [64]  PORT [8031]
set -euo pipefail
PEERS="${ZLLM_PEERS:-$HOME/.cache/zllm-peers}"
MODEL="${MODEL:-$PEERS/models/llama1b/llama1b-Q4_K_M.gguf}"
LLAMA_BIN="${LLAMA_BIN:-$PEERS/llama-build-0.3.36-avx512/bin}"
CORES=$(nproc)
THREADS="${THREADS:-$CORES}"
PROMPTS="${PROMPTS:-6}" INPUT="${INPUT:-128}" OUTPUT="${OUTPUT:-64}" PORT="${PORT:-8031}"
LAST_CORE=$(python3 -c "import os; print(max(os.sched_getaffinity(0)))")
[[ -f $MODEL ]] || { echo "no model at $MODEL (benchmarks/compare.sh makes it)" >&2; exit 1; }
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

wait_health() {
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "server did not come up" >&2; return 1
}

bench() {  # label -> prints "label: median TPOT"
    python3 -m zllm.cli bench serve --base-url "http://127.0.0.1:$PORT" --concurrency 1 \
        --num-prompts "$PROMPTS" --input-len "$INPUT" --output-len "$OUTPUT" \
        --num-warmups 1 --tokenizer "$MODEL" > "$out/$1.txt" 2>&1
    printf '%-28s P50 TPOT %8s ms  P50 TTFT %9s ms\n' "$1" \
        "$(awk '/P50 TPOT/ {print $4}' "$out/$1.txt")" "$(awk '/P50 TTFT/ {print $4}' "$out/$1.txt")"
}

run() {  # label, command...
    local label=$1; shift
    "$@" > "$out/$label.server.log" 2>&1 &
    local server=$!
    wait_health
    bench "$label alone"
    taskset -c "$LAST_CORE" python3 -c "while True: pass" &
    local spin=$!
    sleep 1
    bench "$label beside a busy core"
    kill "$spin"; wait "$spin" 2>/dev/null || true
    kill "$server"; wait "$server" 2>/dev/null || true
    local changes
    changes=$(grep -c "other programs took" "$out/$label.server.log" || true)
    [[ $label == zllm ]] && echo "  (zllm changed its thread count $changes times)"
    sleep 2
}

echo "$(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $CORES cores;" \
    "model $MODEL; $THREADS threads; competitor pinned to core $LAST_CORE"
run zllm env OMP_NUM_THREADS="$THREADS" python3 -m zllm.cli serve "$MODEL" \
    --host 127.0.0.1 --port "$PORT"
run zllm-fixed env OMP_NUM_THREADS="$THREADS" ZLLM_CPU_SHARE=0 python3 -m zllm.cli serve \
    "$MODEL" --host 127.0.0.1 --port "$PORT"
run llama-server "$LLAMA_BIN/llama-server" -m "$MODEL" -t "$THREADS" -np 1 -c 4096 \
    --host 127.0.0.1 --port "$PORT"
