#!/usr/bin/env bash
# What the many-tenant features cost when they are on but nothing uses them (issue 19): the
# same `zllm bench serve` workload (one tenant, no priorities, random prompts that neither hit
# nor leave the pool) against `zllm serve` on the default model with each feature switched on
# alone, in the same run:
#
#   plain      the defaults (fcfs; prefix pinning allowed, up to a tenth of the pool)
#   no-pin     --max-pinned-bytes 0 (pinning off: "plain" is then pinning on but unused)
#   priority   --scheduling-policy priority
#   fair       --scheduling-policy fair
#   tiers      --kv-offload-bytes 1G --kv-offload-dir DIR (CPU and disk tiers, never hit)
#   sleep      --enable-sleep-mode
#
# for ROUNDS rounds (the servers alternate within a round, each round starting one variant
# later, so drift and position spread over all of them). Prints a markdown table of medians
# and each variant's throughput against plain.
#
#   benchmarks/unused_features.sh                          # ~25 min on 2 cores
#   ROUNDS=1 NUM_PROMPTS=16 benchmarks/unused_features.sh  # a quick look
#
# Environment (defaults): MODEL (smollm2), VARIANTS ("plain no-pin priority fair tiers
# sleep"), CONCURRENCY (16), NUM_PROMPTS (64), INPUT_LEN (128), OUTPUT_LEN (64), ROUNDS (3),
# PORT (8023), RESULTS_DIR (/tmp/zllm-unused-<date-time>), PYTHON (python).
set -euo pipefail
MODEL="${MODEL:-smollm2}"
VARIANTS="${VARIANTS:-plain no-pin priority fair tiers sleep}"
CONCURRENCY="${CONCURRENCY:-16}"
NUM_PROMPTS="${NUM_PROMPTS:-64}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
ROUNDS="${ROUNDS:-3}"
PORT="${PORT:-8023}"
PYTHON="${PYTHON:-python}"
RESULTS_DIR="${RESULTS_DIR:-/tmp/zllm-unused-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RESULTS_DIR"
source "$(dirname "$0")/lib.sh"  # start_server, stop_server

options() {  # the zllm serve options of a variant
    case "$1" in
        plain) ;;
        no-pin) echo --max-pinned-bytes 0 ;;
        priority) echo --scheduling-policy priority ;;
        fair) echo --scheduling-policy fair ;;
        tiers) echo --kv-offload-bytes 1G --kv-offload-dir "$RESULTS_DIR/tier" ;;
        sleep) echo --enable-sleep-mode ;;
        *) echo "unknown variant $1" >&2; return 1 ;;
    esac
}

read -ra variants <<<"$VARIANTS"
seed=0
for round in $(seq "$ROUNDS"); do
    for i in "${!variants[@]}"; do
        label="${variants[$(((i + round - 1) % ${#variants[@]}))]}"
        # shellcheck disable=SC2046  # the options are words
        start_server "$label" $(options "$label")
        seed=$((seed + 1))  # fresh prompts for every run: no prefix hits from an earlier one
        "$PYTHON" -m zllm.cli bench serve --base-url "http://127.0.0.1:$PORT" \
            --tokenizer "$MODEL" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" \
            --output-len "$OUTPUT_LEN" --concurrency "$CONCURRENCY" --prompt-seed "$seed" \
            --label "$label" --output-json "$RESULTS_DIR/$label-r$round.json" >/dev/null
        stop_server
        echo "round $round: $label done" >&2
    done
done

"$PYTHON" - "$RESULTS_DIR" $VARIANTS <<'PY'
import glob, json, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    r = json.load(open(path))
    runs[r["label"]].append(r)
print("| server | output tok/s, each round | median | TPOT p50 ms | TTFT p50 ms | schedule ms/step | vs plain |")
print("|---|---|---|---|---|---|---|")
plain = statistics.median(r["output_throughput"] for r in runs["plain"]) if runs["plain"] else None
for label in sys.argv[2:]:
    rs = runs.get(label, [])
    if not rs:
        continue
    tps = statistics.median(r["output_throughput"] for r in rs)
    tpot = statistics.median(r["tpot_ms"]["p50"] for r in rs)
    ttft = statistics.median(r["ttft_ms"]["p50"] for r in rs)
    schedule = statistics.median(r["engine"]["per_step_ms"]["schedule"] for r in rs)
    each = ", ".join(f"{r['output_throughput']:.1f}" for r in rs)
    ratio = f"{tps / plain:.3f}x" if plain else "-"
    print(f"| {label} | {each} | {tps:.1f} | {tpot:.2f} | {ttft:.1f} | {schedule:.3f} | {ratio} |")
PY
