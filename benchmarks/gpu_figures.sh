#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, on a lent GPU machine (after `source
# benchmarks/gpu_env.sh`); each section named on the command line runs, its log in $OUT:
#   steps-8b     decode step times, a random Llama-3-8B shape (bf16), eager vs CUDA graphs,
#                fused layer ops off and on
#   steps-shape  the same for a random SmolLM2 shape
#   steps        the real SmolLM2 (bf16), as configured
#   profile      a batch-1 step's kernels (random SmolLM2 shape), grouped by name
#   divergence   SmolLM2 bf16 (GPU) vs fp32 (CPU): first greedy divergence
#   throughput   zllm bench throughput vs transformers' generate, 256 x 128/128, bf16
#   serve        zllm serve (SmolLM2, bf16) under zllm bench serve at concurrency 1/32/64/256,
#                with GPU utilization sampled by nvidia-smi every 100 ms
#   serve-shape  the same shape with random weights (no model transfer needed), c = 1 and
#                64, with the GPU's idle share between steps from CUDA events, once with the
#                asynchronous executor and once without (ASYNC_MODES="on off"; other
#                concurrencies: SHAPE_CONCURRENCIES="32 256")
# SERVE_ARGS: more zllm serve flags for serve and serve-shape, e.g.
#   SERVE_ARGS="--cudagraph-mode full_and_piecewise" (prefill and mixed steps as graphs)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-figures}; mkdir -p "$OUT"
section() { echo "=== $1 $(date -u +%H:%M:%S)"; }
for step in "$@"; do
  case $step in
  steps-8b|steps-shape)
    # Fused layer ops off, on without the RoPE + cache-write kernel, and on with it
    # (ZLLM_CUDA_LAYER_OPS, ZLLM_CUDA_ROPE_CACHE): what each is worth.
    shape=$([ "$step" = steps-8b ] && echo llama3-8b || echo smollm2-shape)
    for ops in 0 1-split 1; do
      section "$step layer-ops=$ops"
      rope_cache=$([ "$ops" = 1 ] && echo 1 || echo 0)
      ZLLM_CUDA_LAYER_OPS=${ops%-split} ZLLM_CUDA_ROPE_CACHE=$rope_cache timeout 240 \
        python3 benchmarks/gpu_bench.py --output-json "$OUT/$step-ops$ops.json" \
        decode-steps --shape $shape 2>&1 | grep -v "Warning\|warn_once" | tee -a "$OUT/$step.log"
    done ;;
  steps)
    section "$step"
    timeout 150 python3 benchmarks/gpu_bench.py --output-json "$OUT/steps.json" \
      decode-steps --shape smollm2 2>&1 | grep -v Warning | tee "$OUT/steps.log" ;;
  profile)
    section "$step"
    timeout 120 python3 benchmarks/gpu_bench.py profile --top 15 2>&1 \
      | grep -v "Warning\|warn_once" | tee "$OUT/profile.log" ;;
  divergence)
    section "$step"
    timeout 150 python3 benchmarks/gpu_bench.py divergence 2>&1 | grep -v "INFO\|Warning" \
      | tee "$OUT/divergence.log" ;;
  throughput)
    section "$step"
    for backend in zllm transformers; do
      timeout 150 zllm bench throughput --num-prompts 256 --hf-batch-size 256 \
        --backend $backend 2>&1 | grep -v "INFO" | tail -3
    done | tee "$OUT/throughput.log" ;;
  serve-shape)
    # SmolLM2's layer shapes with random weights and the tests' tiny tokenizer (no model
    # transfer): the GPU's idle share between steps at concurrency 1 and 64.
    section "$step"
    python3 - <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import write_tiny_model
write_tiny_model(Path("/tmp/smollm2-shape"), hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 max_position_embeddings=2048, initializer_range=0.02)
PY
    # Once per executor mode (ASYNC_MODES, default "on off"): the asynchronous executor
    # (launch N+1 before N's tokens reach the host) against one step at a time.
    for mode in ${ASYNC_MODES:-on off}; do
      zllm serve /tmp/smollm2-shape --port 8124 --async-executor $mode ${SERVE_ARGS:-} \
        > "$OUT/serve-shape-$mode.log" 2>&1 &
      python3 - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:8124/health", timeout=2)
        break
    except Exception:
        time.sleep(0.5)
PY
      for c in ${SHAPE_CONCURRENCIES:-1 64}; do
        n=$(( c < 16 ? 32 : 4 * c ))
        echo "--- async executor $mode, concurrency $c"
        timeout 150 zllm bench serve --base-url http://127.0.0.1:8124 --concurrency $c \
          --num-prompts $n --input-len 128 --output-len 128 --vocab-size 400 \
          --output-json "$OUT/serve-shape-$mode-c$c.json" 2>&1 | tail -34
      done 2>&1 | tee -a "$OUT/serve-shape-bench.log"
      kill %1; wait
    done ;;
  serve)
    section "$step"
    zllm serve smollm2 --port 8123 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
    python3 - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=2)
        break
    except Exception:
        time.sleep(0.5)
PY
    for c in 1 32 64 256; do
      n=$(( c < 16 ? 32 : 2 * c ))
      nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 \
        > "$OUT/util-c$c.txt" &
      smi=$!
      timeout 150 zllm bench serve --base-url http://127.0.0.1:8123 --concurrency $c \
        --num-prompts $n --input-len 128 --output-len 128 --output-json "$OUT/serve-c$c.json" \
        2>&1 | tail -30
      kill $smi
      sort -n "$OUT/util-c$c.txt" | awk '{a[NR]=$1} END {print "GPU utilization (nvidia-smi, 100 ms samples): median " a[int((NR+1)/2)] "%, n=" NR}'
    done 2>&1 | tee "$OUT/serve-bench.log"
    grep -i "graph\|KV cache\|Attention" "$OUT/serve.log" | head
    kill %1; wait ;;
  esac
done
