# Sourced at the start of every command on a lent GPU machine (the device tool; see
# benchmarks/README.md). That machine has torch, triton, cupy, transformers and tokenizers
# but no package registry, so the rest travels as wheels in .whl/ (carried), and the models
# (SmolLM2 98 MB, Gemma 3 253 MB: over one transfer's 64 MiB) arrive in parts, one per call.
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 ZLLM_CACHE=/tmp/zllm-cache
# ZLLM_BUILD_CPU_KERNELS=0: the install compiles no CPU kernels here (the GPU runs its own;
# a CPU test builds them at first use), so a machine without ninja still installs.
python3 -c "import zllm.core" 2>/dev/null ||
    ZLLM_BUILD_CPU_KERNELS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
# A registered model over the transfer limit travels as .gpu/<dir>/<name>.part-<i> (split -n
# K -d -a 1) over several calls, with <name>.sha256 beside its first part; once the parts
# carried so far join to that digest, the model is put into the cache under its registered
# file name.
mkdir -p /tmp/zllm-parts
for f in .gpu/*/*.part-* .gpu/*/*.sha256; do [ -f "$f" ] && cp "$f" /tmp/zllm-parts/; done
for digest in /tmp/zllm-parts/*.sha256; do
    [ -f "$digest" ] || continue
    name=$(basename "$digest" .sha256)
    file=$(python3 -c "from zllm.model.files import MODEL_REGISTRY; print(MODEL_REGISTRY['$name'].filename)")
    target=$ZLLM_CACHE/models/$name/$file
    [ -f "$target" ] && continue
    mkdir -p "$(dirname "$target")"
    cat $(ls /tmp/zllm-parts/"$name".part-* | sort -V) > "$target.tmp"
    if [ "$(sha256sum "$target.tmp" | cut -d' ' -f1)" = "$(cat "$digest")" ]; then
        mv "$target.tmp" "$target"; echo "$name assembled"
    else
        rm -f "$target.tmp"; echo "$name: $(ls /tmp/zllm-parts/"$name".part-* | wc -l) part(s) so far"
    fi
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
