# Sourced at the start of every command on a lent GPU machine (the device tool; see
# benchmarks/README.md). That machine has torch, triton, cupy, transformers and tokenizers
# but no package registry, so the rest travels as wheels in .whl/ (carried), and SmolLM2
# (98 MB, over one transfer's 64 MiB) arrives in two parts over two calls: .gpu/a and .gpu/b,
# assembled into the model cache and checked against .gpu/a/sha256.
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 ZLLM_CACHE=/tmp/zllm-cache
python3 -c "import zllm.core" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
mkdir -p /tmp/zllm-parts
for part in .gpu/a/part-* .gpu/b/part-*; do [ -f "$part" ] && cp "$part" /tmp/zllm-parts/; done
[ -f .gpu/a/sha256 ] && cp .gpu/a/sha256 /tmp/zllm-parts/
gguf=$ZLLM_CACHE/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ -f /tmp/zllm-parts/part-aa ] && [ -f /tmp/zllm-parts/part-ab ]; then
    mkdir -p "$(dirname "$gguf")"
    cat /tmp/zllm-parts/part-a? > "$gguf.tmp"
    if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" = "$(cat /tmp/zllm-parts/sha256)" ]; then
        mv "$gguf.tmp" "$gguf"
    else
        echo "SmolLM2 parts do not match their sha256" >&2; rm -f "$gguf.tmp"
    fi
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
