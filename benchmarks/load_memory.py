"""An executor's resident memory before its weights load and after (issue 37's memory goal:
the growth at most the weight file + the KV pool + 150 MB). Run it as its own process: the
figures are this process's VmRSS.

    python benchmarks/load_memory.py MODEL [--quantization gguf] [--max-model-len N]
        [--kv-cache-memory-bytes 64M]

Prints one JSON line: before, after (bytes), the quantization the runner took, the weights'
size on disk and the pool's size. tests/test_gguf_kernels.py and tests/test_gemma3.py assert
the goal's bound on it.
"""

from __future__ import annotations

import argparse
import json
import os


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def weights_on_disk(model: str) -> int:
    if os.path.isfile(model):
        return os.path.getsize(model)
    return sum(
        os.path.getsize(os.path.join(model, name))
        for name in os.listdir(model)
        if name.endswith(".safetensors")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", default="64M")
    args = parser.parse_args()

    from zllm.config.arg_utils import parse_size
    from zllm.config.engine_args import EngineArgs
    from zllm.executor.kernels import cpu as cpu_kernels
    from zllm.executor.model_runner import ModelRunner

    cpu_kernels.load()
    pool = parse_size(args.kv_cache_memory_bytes)
    config = EngineArgs(
        args.model,
        quantization=args.quantization,
        kv_cache_memory_bytes=pool,
        max_model_len=args.max_model_len,
    ).create_engine_config()
    before = vm_rss()
    runner = ModelRunner(config)
    after = vm_rss()
    print(
        json.dumps(
            {
                "model": args.model,
                "before": before,
                "after": after,
                "method": runner.quantization,
                "weights_bytes": weights_on_disk(args.model),
                "pool_bytes": pool,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
