#!/usr/bin/env bash
# LoRA serving cost, in the same run: `zllm serve` on the default model without LoRA, and
# with --enable-lora serving four rank-16 adapters on every projection
# (benchmarks/make_lora_adapters.py), each driven by `zllm bench serve` at one concurrency:
#
#   plain       no LoRA
#   unused      --enable-lora, every request names the base model (LoRA on, unused)
#   1 adapter   every request names lora1
#   4 adapters  requests name lora1..lora4 in turn (every step mixes all four)
#
# for ROUNDS rounds (servers alternate within a round). Prints a markdown table of medians.
#
#   benchmarks/lora.sh                               # ~15 min on 2 cores
#   ROUNDS=1 NUM_PROMPTS=32 benchmarks/lora.sh       # a quick look
#   SERVE_ARGS="--tensor-parallel-size 2" benchmarks/lora.sh   # the same over two ranks
#
# Environment (defaults): MODEL (smollm2), CONCURRENCY (32), NUM_PROMPTS (64), INPUT_LEN
# (128), OUTPUT_LEN (64), RANK (16), ROUNDS (3), PORT (8022), RESULTS_DIR
# (/tmp/zllm-lora-<date-time>), PYTHON (python), SERVE_ARGS (more `zllm serve` options, for
# both servers).
set -euo pipefail
MODEL="${MODEL:-smollm2}"
CONCURRENCY="${CONCURRENCY:-32}"
NUM_PROMPTS="${NUM_PROMPTS:-64}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
RANK="${RANK:-16}"
ROUNDS="${ROUNDS:-3}"
PORT="${PORT:-8022}"
PYTHON="${PYTHON:-python}"
read -r -a serve_args <<<"${SERVE_ARGS:-}"
RESULTS_DIR="${RESULTS_DIR:-/tmp/zllm-lora-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RESULTS_DIR"
cd "$(dirname "$0")/.."

"$PYTHON" benchmarks/make_lora_adapters.py "$RESULTS_DIR/adapters" --model "$MODEL" \
    --count 4 --rank "$RANK" >/dev/null
modules=()
for i in 1 2 3 4; do modules+=("lora$i=$RESULTS_DIR/adapters/lora$i"); done

source benchmarks/lib.sh  # start_server, stop_server (after the cd above)

bench() {  # $1: label, $2: prompt seed, $3: round, then zllm bench serve options
    # Each variant draws its own prompts: on the LoRA server a later run would otherwise find
    # an earlier one's prompts in the prefix cache (same adapter, same tokens).
    local label="$1" seed="$2" round="$3"
    shift 3
    "$PYTHON" -m zllm.cli bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" \
        --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --concurrency "$CONCURRENCY" --prompt-seed "$seed" --label "$label" "$@" \
        --output-json "$RESULTS_DIR/$label-r$round.json" >/dev/null
    echo "round $round: $label done" >&2
}

for round in $(seq "$ROUNDS"); do
    start_server plain --served-model-name base "${serve_args[@]}"
    bench plain 1 "$round" --model base
    stop_server
    start_server lora --served-model-name base --enable-lora --max-loras 4 --max-lora-rank "$RANK" \
        --lora-modules "${modules[@]}" "${serve_args[@]}"
    bench unused 2 "$round" --model base
    bench 1-adapter 3 "$round" --model lora1
    bench 4-adapters 4 "$round" --lora-modules lora1 lora2 lora3 lora4
    stop_server
done

"$PYTHON" - "$RESULTS_DIR" <<'PY'
import glob, json, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    r = json.load(open(path))
    runs[r["label"]].append(r)
print("| server / requests | rounds | output tok/s (median) | TPOT p50 ms | executor ms/step | vs plain |")
print("|---|---|---|---|---|---|")
plain = statistics.median(r["output_throughput"] for r in runs["plain"])
for label in ("plain", "unused", "1-adapter", "4-adapters"):
    rs = runs.get(label, [])
    if not rs:
        continue
    tps = statistics.median(r["output_throughput"] for r in rs)
    tpot = statistics.median(r["tpot_ms"]["p50"] for r in rs)
    step = statistics.median(r["engine"]["per_step_ms"]["busy"] for r in rs)
    each = ", ".join(f"{r['output_throughput']:.1f}" for r in rs)
    print(f"| {label} | {each} | {tps:.1f} | {tpot:.2f} | {step:.1f} | {tps / plain:.3f}x |")
PY
