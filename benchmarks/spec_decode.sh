#!/usr/bin/env bash
# Speculative decoding against the same server without it, in the same run: `zllm serve` on
# the default model with and without --speculative-config, each driven by `zllm bench serve`
# on a workload where prompt lookup pays (--dataset edit: rewrite given code or text) and one
# where it does not (--dataset free: open-ended writing), at each concurrency, for ROUNDS
# rounds (servers alternate within a round). Prints a markdown table of medians.
#
#   benchmarks/spec_decode.sh                       # ~25 min on 2 cores
#   ROUNDS=1 NUM_PROMPTS=4 benchmarks/spec_decode.sh  # a quick look
#
# Environment (defaults): MODEL (smollm2), SPEC ('{"method": "ngram",
# "num_speculative_tokens": 4}'), DATASETS ("edit free"), CONCURRENCIES ("1 8"), ROUNDS (3),
# NUM_PROMPTS (8 at c=1; c x 2 above), OUTPUT_LEN (128), PORT (8021), RESULTS_DIR
# (/tmp/zllm-spec-<date-time>), PYTHON (python).
set -euo pipefail
MODEL="${MODEL:-smollm2}"
SPEC="${SPEC:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}"
DATASETS="${DATASETS:-edit free}"
CONCURRENCIES="${CONCURRENCIES:-1 8}"
ROUNDS="${ROUNDS:-3}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT="${PORT:-8021}"
PYTHON="${PYTHON:-python}"
RESULTS_DIR="${RESULTS_DIR:-/tmp/zllm-spec-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RESULTS_DIR"

source "$(dirname "$0")/lib.sh"  # start_server, stop_server

for round in $(seq "$ROUNDS"); do
    for label in plain spec; do
        if [ "$label" = spec ]; then
            start_server "$label" --speculative-config "$SPEC"
        else
            start_server "$label"
        fi
        for dataset in $DATASETS; do
            for c in $CONCURRENCIES; do
                n="${NUM_PROMPTS:-$([ "$c" = 1 ] && echo 8 || echo $((c * 2)))}"
                "$PYTHON" -m zllm.cli bench serve --base-url "http://127.0.0.1:$PORT" \
                    --dataset "$dataset" --tokenizer "$MODEL" --num-prompts "$n" \
                    --output-len "$OUTPUT_LEN" --concurrency "$c" --label "$label" \
                    --output-json "$RESULTS_DIR/$label-$dataset-c$c-r$round.json" >/dev/null
                echo "round $round: $label $dataset c=$c done" >&2
            done
        done
        stop_server
    done
done

"$PYTHON" - "$RESULTS_DIR" <<'EOF'
import glob, json, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    r = json.load(open(path))
    runs[(r["dataset"], r["concurrency"], r["label"])].append(r)
print("| workload | conc. | server | output tok/s | TPOT p50 ms | acceptance | tokens/verify | step ms | idle ms/step | TPOT ratio | tok/s ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for dataset, c in sorted({(d, c) for d, c, _ in runs}, key=lambda k: (k[0], k[1])):
    med = {}
    for label in ("plain", "spec"):
        rs = runs.get((dataset, c, label), [])
        if not rs:
            continue
        spec = [r["engine"].get("spec_decode") for r in rs if (r.get("engine") or {}).get("spec_decode")]
        med[label] = (
            statistics.median(r["output_throughput"] for r in rs),
            statistics.median(r["tpot_ms"]["p50"] for r in rs),
            statistics.median(s["acceptance_rate"] for s in spec) if spec else None,
            statistics.median(s["mean_acceptance_length"] for s in spec) if spec else None,
            statistics.median(r["engine"]["per_step_ms"]["busy"] for r in rs),
            statistics.median(r["engine"]["per_step_ms"]["idle"] for r in rs),
        )
    for label, (tps, tpot, acc, length, busy, idle) in med.items():
        ratio = ""
        if label == "spec" and "plain" in med:
            ratio = f"{med['plain'][1] / tpot:.2f}x | {tps / med['plain'][0]:.2f}x"
        else:
            ratio = "- | -"
        acc_s = f"{acc:.1%}" if acc is not None else "-"
        len_s = f"{length:.2f}" if length is not None else "-"
        print(
            f"| {dataset} | {c} | {label} | {tps:.1f} | {tpot:.2f} | {acc_s} | {len_s} "
            f"| {busy:.1f} | {idle:.2f} | {ratio} |"
        )
EOF
