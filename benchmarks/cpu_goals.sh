#!/usr/bin/env bash
# Issue 37's goals in one command: zllm against llama-server (the native build) on the
# random-weight Llama-3.2-1B-shaped model and on SmolLM2, the machine's decode floor, memory
# after load, start-up time, logits against transformers and the int8 KV cache, each engine
# alone on the machine in turn; then one table of every goal with its ratio and whether it
# is met (benchmarks/cpu_goals.py). Everything it builds or writes goes under $CACHE (see
# benchmarks/compare.sh, whose runs it drives), nothing into the repository.
#
#   benchmarks/cpu_goals.sh                      # every part, ~40 min on the 2-core machine
#   PARTS="floor memory startup" benchmarks/cpu_goals.sh
#
# Environment (defaults in brackets):
#   CACHE [~/.cache/zllm-peers]  GOALS_DIR [$CACHE/results/goals-<date-time>]  results; the
#           table is written to $GOALS_DIR/goals.md
#   PARTS ["setup llama1b prefill 16bit smollm2 floor memory startup logits kv report"]
#           Issue 57's goals are their own parts, not in the default: setup57 (builds the three
#           shapes), qwen3 (Qwen3-1.7B's shape, Q4_K_M c=1 and its memory after load), moe
#           (Qwen3-30B-A3B's layers, Q4_K_M c=1 and c=8), gptoss (gpt-oss-20b's layers,
#           MXFP4 experts, c=1), qwen3-q3 (Q3_K_M c=1), floor57 (each file's decode floor)
#           Issue 58's, also their own parts: setup58 (vLLM's CPU build), default58 (the 1B
#           shape's Q4_K_M with default flags against llama-server's Q4_K_M and Q8_0, c=1, 8,
#           32; zllm again with ZLLM_CPU_ISA=avx2), vllm58 (SmolLM2's fp32 directory, both
#           engines), vllm58-1b (the 1B shape's bf16 directory, both engines; llama-server on
#           its F16 GGUF at c=1), logits58 (the default's logits
#           on the Q4_K_M file against transformers, beside gguf-float's and gguf-int8's),
#           avx2-58 (with LLAMA_NATIVE=OFF: both engines held to AVX2, zllm by ZLLM_CPU_ISA=avx2,
#           llama-server by its portable build; default58's cells; STEPS58 picks engines)
#           Issue 59's: quant59 (the 1B shape as compressed-tensors W4A16 and W8A8 checkpoints,
#           made from its bf16 directory, against its Q4_K_M and Q8_0 GGUFs; memory after load)
#   LLAMA_NATIVE [ON]  QUIET_LOAD [""]  PYTHON [python]  passed on to compare.sh
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CACHE=${CACHE:-$HOME/.cache/zllm-peers}
export LLAMA_NATIVE=${LLAMA_NATIVE:-ON}
export PYTHON=${PYTHON:-python}
GOALS_DIR=${GOALS_DIR:-$CACHE/results/goals-$(date +%Y%m%d-%H%M%S)}
PARTS=${PARTS:-"setup llama1b prefill 16bit smollm2 floor memory startup logits kv report"}
LLAMA1B=$CACHE/models/llama1b
Q4=$LLAMA1B/llama1b-Q4_K_M.gguf
INT8="--quantization gguf-int8"
# compare.sh's llama.cpp build (the native one unless LLAMA_NATIVE=OFF).
LLAMA_BUILD=$CACHE/llama-build-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
[[ $LLAMA_NATIVE == ON ]] || LLAMA_BUILD=$LLAMA_BUILD-portable

has_part() { [[ " $PARTS " == *" $1 "* ]]; }
log() { printf '\n== %s: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$GOALS_DIR"

# compare DIR VAR=VALUE...: one benchmarks/compare.sh run into $GOALS_DIR/DIR.
compare() {
    local dir=$1
    shift
    env RESULTS_DIR="$GOALS_DIR/$dir" "$@" "$REPO/benchmarks/compare.sh"
}

# Both engines' figures at 128 in / 64 out: zllm's default (the float GGUF kernel) and
# gguf-int8 (llama.cpp's own arithmetic: x rounded to int8 per block), llama-server on the
# Q4_K_M and Q8_0 files. c=32 takes 32 prompts; c=1 and c=8 take 16.
llama1b_cells() {
    local dir=$1
    shift
    compare "$dir" MODEL=llama1b-q4km STEPS="zllm llama-q4 llama-q8" "$@"
    compare "$dir" MODEL=llama1b-q4km STEPS="zllm" ZLLM_LABEL=zllm-gguf-int8 \
        ZLLM_SERVE_ARGS="$INT8" "$@"
}

if has_part setup; then
    compare setup MODEL=llama1b-q4km STEPS=setup
    compare setup MODEL=smollm2 STEPS=setup
fi
if has_part llama1b; then
    llama1b_cells llama1b NUM_PROMPTS=16 INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCIES="1 8"
    llama1b_cells llama1b-c32 NUM_PROMPTS=32 INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCIES=32
fi
if has_part prefill; then
    compare prefill MODEL=llama1b-q4km STEPS="zllm llama-q4" NUM_PROMPTS=3 INPUT_LEN=1024 \
        OUTPUT_LEN=16 CONCURRENCIES=1
    compare prefill MODEL=llama1b-q4km STEPS=zllm ZLLM_LABEL=zllm-gguf-int8 \
        ZLLM_SERVE_ARGS="$INT8" NUM_PROMPTS=3 INPUT_LEN=1024 OUTPUT_LEN=16 CONCURRENCIES=1
fi
if has_part 16bit; then
    compare 16bit MODEL=llama1b-q4km STEPS="zllm-bf16 zllm-f16 llama-f16" NUM_PROMPTS=4 \
        INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCIES=1
fi
if has_part smollm2; then
    compare smollm2 MODEL=smollm2 STEPS="zllm llama-q4 llama-f16" NUM_PROMPTS=32 \
        INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCIES="1 8 32"
    compare smollm2 MODEL=smollm2 STEPS=zllm ZLLM_LABEL=zllm-gguf-int8 ZLLM_SERVE_ARGS="$INT8" \
        NUM_PROMPTS=32 INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCIES="1 8 32"
fi
if has_part floor; then
    log "the decode floor of $Q4"
    "$PYTHON" "$REPO/benchmarks/memory_floor.py" "$Q4" --output-json "$GOALS_DIR/floor.json"
fi
if has_part memory; then
    for model in "$Q4" "$LLAMA1B/llama1b-F16.gguf" "$LLAMA1B/hf-bf16"; do
        log "resident memory after loading $model"
        OMP_NUM_THREADS=1 "$PYTHON" "$REPO/benchmarks/load_memory.py" "$model" |
            tail -1 >"$GOALS_DIR/memory-$(basename "$model").json"
    done
fi
if has_part startup; then
    log "start-up to /health, both engines on $Q4"
    "$PYTHON" "$REPO/benchmarks/startup_time.py" --repeats 5 \
        --output-json "$GOALS_DIR/startup.json" \
        --engine "zllm=zllm serve $Q4 --port {port}" \
        --engine "llama-server=$LLAMA_BUILD/bin/llama-server -m $Q4 -t 2 -np 32 -c 16384 --host 127.0.0.1 --port {port}"
fi
if has_part logits; then
    log "logits against transformers on $LLAMA1B/hf-bf16"
    "$PYTHON" "$REPO/benchmarks/logits_parity.py" "$LLAMA1B/hf-bf16" \
        --output-json "$GOALS_DIR/logits.json"
fi
if has_part kv; then
    for kv in auto int8; do
        log "a decode step at 4K context, c=8, KV $kv (SmolLM2)"
        "$PYTHON" "$REPO/benchmarks/kv_decode.py" smollm2 --kv-cache-dtype "$kv" --batch 8 |
            tail -1 >"$GOALS_DIR/kv-$kv.json"
    done
fi
# Issue 57: zllm's two arithmetics and llama-server on one file of a shape (c=1 takes 16
# prompts, c=8 two waves of 8).
MODELS=$CACHE/models
shape_cells() {
    local dir=$1 gguf=$2
    shift 2
    compare "$dir" MODEL="$gguf" STEPS="zllm llama-q4" "$@"
    compare "$dir" MODEL="$gguf" STEPS="zllm" ZLLM_LABEL=zllm-gguf-int8 ZLLM_SERVE_ARGS="$INT8" "$@"
}
if has_part setup57; then
    compare setup57 MODEL=qwen3-1.7b-q4km SHAPE_QUANTS="Q4_K_M Q3_K_M" STEPS=setup
    compare setup57 MODEL=qwen3moe-a3b-q4km SHAPE_QUANTS=Q4_K_M STEPS=setup
    compare setup57 MODEL=gpt-oss-20b-q4km SHAPE_QUANTS=MXFP4_MOE STEPS=setup
fi
CELL57=(NUM_PROMPTS=16 INPUT_LEN=128 OUTPUT_LEN=64)
if has_part qwen3; then
    shape_cells qwen3 "$MODELS/qwen3-1.7b/qwen3-1.7b-Q4_K_M.gguf" "${CELL57[@]}" CONCURRENCIES=1
    OMP_NUM_THREADS=1 "$PYTHON" "$REPO/benchmarks/load_memory.py" \
        "$MODELS/qwen3-1.7b/qwen3-1.7b-Q4_K_M.gguf" | tail -1 >"$GOALS_DIR/memory-qwen3-1.7b.json"
fi
if has_part moe; then
    shape_cells moe "$MODELS/qwen3moe-a3b/qwen3moe-a3b-Q4_K_M.gguf" "${CELL57[@]}" \
        CONCURRENCIES="1 8"
fi
if has_part gptoss; then
    shape_cells gptoss "$MODELS/gpt-oss-20b/gpt-oss-20b-MXFP4_MOE.gguf" "${CELL57[@]}" \
        CONCURRENCIES=1
fi
if has_part qwen3-q3; then
    shape_cells qwen3-q3 "$MODELS/qwen3-1.7b/qwen3-1.7b-Q3_K_M.gguf" "${CELL57[@]}" \
        CONCURRENCIES=1
fi
if has_part floor57; then
    for gguf in qwen3-1.7b/qwen3-1.7b-Q4_K_M qwen3-1.7b/qwen3-1.7b-Q3_K_M \
        qwen3moe-a3b/qwen3moe-a3b-Q4_K_M gpt-oss-20b/gpt-oss-20b-MXFP4_MOE; do
        "$PYTHON" "$REPO/benchmarks/memory_floor.py" "$MODELS/$gguf.gguf" \
            --output-json "$GOALS_DIR/floor-$(basename "$gguf").json"
    done
fi
# Issue 58: every engine as a user starts it (default flags), on the same files.
CELL58=(INPUT_LEN=128 OUTPUT_LEN=64)
cells58() {  # c=1 and c=8 on 16 prompts, c=32 on 32
    local dir=$1
    shift
    compare "$dir" "${CELL58[@]}" NUM_PROMPTS=16 CONCURRENCIES="1 8" "$@"
    compare "$dir-c32" "${CELL58[@]}" NUM_PROMPTS=32 CONCURRENCIES=32 "$@"
}
if has_part setup58; then
    compare setup58 MODEL=llama1b-q4km STEPS="setup vllm-setup"
fi
if has_part default58; then
    cells58 default58 MODEL=llama1b-q4km STEPS="zllm llama-q4 llama-q8" ZLLM_LABEL=zllm-default
    ZLLM_CPU_ISA=avx2 cells58 default58 MODEL=llama1b-q4km STEPS=zllm \
        ZLLM_LABEL=zllm-default-avx2
fi
if has_part avx2-58; then  # run with LLAMA_NATIVE=OFF: llama.cpp's portable AVX2 build
    ZLLM_CPU_ISA=avx2 cells58 avx2-58 MODEL=llama1b-q4km STEPS="${STEPS58:-zllm llama-q4 llama-q8}" \
        ZLLM_LABEL=zllm-default-avx2
fi
# Issue 59: the 1B shape's bf16 directory quantized as llm-compressor writes W4A16 (int4, group
# 128), W8A8 and FP8_DYNAMIC (benchmarks/quantize_checkpoint.py), against the same shape's GGUFs in zllm
# and llama-server's Q4_K_M; each checkpoint's resident memory after load.
if has_part quant59; then
    for scheme in W4A16 W8A8 FP8_DYNAMIC; do
        dir=$LLAMA1B/ct-${scheme,,}
        [[ -d $dir ]] || "$PYTHON" "$REPO/benchmarks/quantize_checkpoint.py" "$LLAMA1B/hf-bf16" \
            "$dir" --scheme "$scheme"
        "$PYTHON" "$REPO/benchmarks/load_memory.py" "$dir" | tail -1 \
            >"$GOALS_DIR/memory59-${scheme,,}.json"
    done
    cell59() { compare quant59 "${CELL58[@]}" NUM_PROMPTS=16 CONCURRENCIES="1 8" "$@"; }
    cell59 MODEL=llama1b-q4km STEPS="zllm llama-q4" ZLLM_LABEL=zllm-Q4_K_M
    cell59 MODEL="$LLAMA1B/ct-w4a16" STEPS=zllm ZLLM_LABEL=zllm-ct-w4a16
    cell59 MODEL="$LLAMA1B/llama1b-Q8_0.gguf" STEPS=zllm ZLLM_LABEL=zllm-Q8_0
    cell59 MODEL="$LLAMA1B/ct-w8a8" STEPS=zllm ZLLM_LABEL=zllm-ct-w8a8
    cell59 MODEL="$LLAMA1B/ct-fp8_dynamic" STEPS=zllm ZLLM_LABEL=zllm-ct-fp8-dynamic
fi
if has_part vllm58; then
    cells58 vllm58-smollm2 MODEL=smollm2 STEPS="zllm-hf vllm"
fi
if has_part vllm58-1b; then
    cells58 vllm58-llama1b MODEL=llama1b-q4km STEPS="zllm-hf vllm"
    # The bf16 directory's c=1 goal against llama-server on the same shape's F16 GGUF.
    compare vllm58-llama1b "${CELL58[@]}" NUM_PROMPTS=16 CONCURRENCIES=1 MODEL=llama1b-q4km \
        STEPS=llama-f16
fi
if has_part logits58; then
    for method in gguf gguf-float gguf-int8; do
        log "logits of $Q4 ($method) against transformers"
        "$PYTHON" "$REPO/benchmarks/logits_parity.py" "$Q4" --quantization "$method" \
            --config "$LLAMA1B/hf-bf16" --output-json "$GOALS_DIR/logits58-$method.json"
    done
fi
if has_part report; then
    "$PYTHON" "$REPO/benchmarks/cpu_goals.py" "$GOALS_DIR" | tee "$GOALS_DIR/goals.md"
fi
