#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, on a lent GPU machine (after `source
# benchmarks/gpu_env.sh`); each section named on the command line runs, its log in $OUT:
#   steps-8b     decode step times, a random Llama-3-8B shape (bf16), eager vs CUDA graphs,
#                fused layer ops off and on
#   steps-shape  the same for a random SmolLM2 shape
#   steps-8b-blocks  the 8B shape's decode steps with its decoder matmuls as random Q4_0
#                (W4A16), FP8_E4M3 and Q8_0 blocks (a quantized checkpoint's layouts,
#                csrc/block_gemv.cu), against their bytes floor (BLOCK_KINDS="q4_0 fp8 q8_0")
#   steps        the real SmolLM2 (bf16), as configured
#   profile      a batch-1 step's kernels (random SmolLM2 shape), grouped by name
#   moe          a mixture-of-experts decode step (8 of Qwen3-30B-A3B's layers, random bf16):
#                per-expert matmuls vs the expert kernel vs CUDA graphs, against its bytes
#                floor (benchmarks/gpu_moe.py)
#   divergence   SmolLM2 bf16 (GPU) vs fp32 (CPU): first greedy divergence
#   throughput   zllm bench throughput vs transformers' generate, 256 x 128/128, bf16
#   serve        zllm serve (SmolLM2, bf16) under zllm bench serve at concurrency 1/32/64/256,
#                with GPU utilization sampled by nvidia-smi every 100 ms
#   serve-parity PARITY_MODEL (smollm2) served on the GPU in PARITY_DTYPE (float32) against
#                the CPU engine's fp32 answers, recorded here with benchmarks/serve_parity.py
#                record into .gpu/*/<model>-fp32-cpu.json (carried): 16 greedy prompts, as
#                chat turns or (PARITY_ENDPOINT=completions, for base models) raw text
#   serve-shape  the same shape with random weights (no model transfer needed), c = 1 and
#                64, with the GPU's idle share between steps from CUDA events, once with the
#                asynchronous executor and once without (ASYNC_MODES="on off"; other
#                concurrencies: SHAPE_CONCURRENCIES="32 256")
#   serve-8b     a Llama-3-8B shape (bf16, --load-format dummy: random weights, no files; the
#                tests' 440-token tokenizer and vocabulary) served at concurrency 64
#   tests        every tests/executor/kernels/test_cuda*.py that needs no real model, riskiest
#                first (the MoE expert kernel, quantized blocks, sinks, prefill, then
#                test_cuda.py), one process, each test under TEST_TIMEOUT s (default 150)
#   tests-models the ones that need SmolLM2 (carried as .gpu parts): its fp32 parity and
#                Qwen2.5-VL on the CUDA backend (Gemma 3 too once its parts are carried)
# SERVE_ARGS: more zllm serve flags for serve and serve-shape, e.g.
#   SERVE_ARGS="--cudagraph-mode full_and_piecewise" (prefill and mixed steps as graphs)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-figures}; mkdir -p "$OUT"
section() { echo "=== $1 $(date -u +%H:%M:%S)"; }
# The lines of zllm bench serve's table that BENCHMARKS.md quotes (the whole table is ~60).
bench_lines() {
  grep -E "Successful|Failed|throughput|TTFT|TPOT|ITL|E2E|idle|launched|Executor step|inputs|forward|logits|Core"
}
wait_healthy() {  # the server on port $1 (process $2) answering /health; fails at once if it exits
  for _ in $(seq 240); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
      2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited before serving" >&2; return 1; }
    sleep 0.5
  done
  echo "server on port $1 not healthy after 120 s" >&2; return 1
}
KERNEL_TESTS=tests/executor/kernels
run_tests() {  # $1: log name; the rest: pytest arguments
  local log=$1; shift
  timeout ${TESTS_BUDGET:-330} python3 -m pytest -n 0 -v -rfE --durations=15 \
    --timeout ${TEST_TIMEOUT:-150} "$@" 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/$log.log"
}
for step in "$@"; do
  case $step in
  tests)
    section "$step"
    run_tests tests $KERNEL_TESTS/test_cuda_moe.py $KERNEL_TESTS/test_cuda_quant.py \
      $KERNEL_TESTS/test_cuda_sinks.py $KERNEL_TESTS/test_cuda_prefill.py \
      $KERNEL_TESTS/test_cuda_state.py \
      $KERNEL_TESTS/test_cuda.py -k "not smollm2" ;;
  tests-models)
    section "$step"
    gemma=$(python3 -c "from zllm.model.files import MODEL_REGISTRY as R; import os; \
print(os.path.exists('$ZLLM_CACHE/models/gemma3/' + R['gemma3'].filename))")
    run_tests tests-models $KERNEL_TESTS/test_cuda.py $KERNEL_TESTS/test_cuda_vision.py \
      -k "smollm2 or qwen$([ "$gemma" = True ] && echo ' or gemma3')" ;;
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
  steps-8b-blocks)
    for kind in ${BLOCK_KINDS:-q4_0 fp8 q8_0}; do
      section "$step $kind"
      timeout 240 python3 benchmarks/gpu_bench.py --output-json "$OUT/steps-8b-$kind.json" \
        decode-steps --shape llama3-8b --blocks "$kind" 2>&1 | grep -v "Warning\|warn_once" \
        | tee -a "$OUT/$step.log"
    done ;;
  moe)
    section "$step"
    timeout 300 python3 benchmarks/gpu_moe.py --output-json "$OUT/moe.json" 2>&1 \
      | grep -v "Warning\|warn_once" | tee "$OUT/moe.log" ;;
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
      wait_healthy 8124 $! || { kill %1 2>/dev/null; wait; continue; }
      for c in ${SHAPE_CONCURRENCIES:-1 64}; do
        n=$(( c < 16 ? 32 : 4 * c ))
        echo "--- async executor $mode, concurrency $c"
        timeout 150 zllm bench serve --base-url http://127.0.0.1:8124 --concurrency $c \
          --num-prompts $n --input-len 128 --output-len 128 --vocab-size 400 \
          --output-json "$OUT/serve-shape-$mode-c$c.json" 2>&1 | bench_lines
      done 2>&1 | tee -a "$OUT/serve-shape-bench.log"
      kill %1; wait
    done ;;
  serve-8b)
    section "$step"
    python3 - <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import write_tiny_model
write_tiny_model(Path("/tmp/llama3-8b-shape"), weights=False, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)
PY
    zllm serve /tmp/llama3-8b-shape --port 8126 --load-format dummy --dtype bfloat16 \
      ${SERVE_ARGS:-} > "$OUT/serve-8b.log" 2>&1 &
    wait_healthy 8126 $! || { kill %1 2>/dev/null; wait; continue; }
    timeout 200 zllm bench serve --base-url http://127.0.0.1:8126 --concurrency 64 \
      --num-prompts 256 --input-len 128 --output-len 128 --vocab-size 400 \
      --output-json "$OUT/serve-8b-c64.json" 2>&1 | bench_lines | tee "$OUT/serve-8b-bench.log"
    kill %1; wait ;;
  serve-parity)
    section "$step"
    model=${PARITY_MODEL:-smollm2}
    zllm serve $model --port 8125 --dtype ${PARITY_DTYPE:-float32} --quantization none \
      > "$OUT/serve-parity-$model.log" 2>&1 &
    wait_healthy 8125 $! || { kill %1 2>/dev/null; wait; continue; }
    timeout 150 python3 benchmarks/serve_parity.py compare --base-url http://127.0.0.1:8125 \
      --reference .gpu/*/$model-fp32-cpu.json --endpoint ${PARITY_ENDPOINT:-chat} 2>&1 | tee "$OUT/serve-parity-$model.txt"
    kill %1; wait ;;
  serve)
    section "$step"
    zllm serve smollm2 --port 8123 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
    wait_healthy 8123 $! || { kill %1 2>/dev/null; wait; continue; }
    for c in 1 32 64 256; do
      n=$(( c < 16 ? 32 : 2 * c ))
      nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 \
        > "$OUT/util-c$c.txt" &
      smi=$!
      timeout 150 zllm bench serve --base-url http://127.0.0.1:8123 --concurrency $c \
        --num-prompts $n --input-len 128 --output-len 128 --output-json "$OUT/serve-c$c.json" \
        2>&1 | bench_lines
      kill $smi
      sort -n "$OUT/util-c$c.txt" | awk '{a[NR]=$1} END {print "GPU utilization (nvidia-smi, 100 ms samples): median " a[int((NR+1)/2)] "%, n=" NR}'
    done 2>&1 | tee "$OUT/serve-bench.log"
    grep -i "graph\|KV cache\|Attention" "$OUT/serve.log" | head
    kill %1; wait ;;
  esac
done
