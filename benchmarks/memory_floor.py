"""The c=1 decode floor of a GGUF model on this machine: the bytes one decode step must read
(every matrix once, the KV cache of one sequence) over the machine's read bandwidth
(issue 37's floor goal: c=1 TPOT within 1.25x of it).

    python benchmarks/memory_floor.py MODEL.gguf [--context 192] [--output-json F]

Bandwidth: torch's `sum` over a 1 GiB fp32 tensor (two threads on the 2-core machines), the
median of 5 passes after 2 warm-ups; a read-only stream, as a decode step's weights are.
Bytes: every tensor of the file except the token embedding's when the model has its own
output matrix (then a step reads one embedding row, not the matrix); a tied embedding is
read whole, as the logits. A mixture of experts' expert tensors (`*_exps`) count at
experts-used / experts of their size: one token reads only its top-k experts. The KV cache: 2 (K and V) x layers x KV heads x head dim x
4 bytes (the CPU engine's fp32 pool) x context tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from zllm.model.gguf import read_gguf


def step_bytes(path: str, context: int) -> dict[str, int]:
    gguf = read_gguf(path)
    names = gguf.tensors
    arch = gguf.metadata["general.architecture"]
    meta = gguf.metadata
    experts = int(meta.get(f"{arch}.expert_count", 0))
    active = int(meta.get(f"{arch}.expert_used_count", 0)) / experts if experts else 1.0
    matrices = round(
        sum(
            info.nbytes * (active if "_exps." in name else 1.0)
            for name, info in names.items()
            if not (name == "token_embd.weight" and "output.weight" in names)
        )
    )
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    )
    kv = 2 * layers * kv_heads * head_dim * 4 * context
    return {"matrix_bytes": matrices, "kv_bytes": kv}


def read_bandwidth(gib: float = 1.0, passes: int = 5, warmup: int = 2) -> float:
    """Bytes per second torch's sum reads from a tensor too large for any cache."""
    import torch

    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    times = []
    for i in range(warmup + passes):
        start = time.perf_counter()
        data.sum()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--context", type=int, default=192, help="tokens in the KV cache")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    sizes = step_bytes(args.model, args.context)
    bandwidth = read_bandwidth()
    total = sizes["matrix_bytes"] + sizes["kv_bytes"]
    result = {
        "model": args.model,
        "context": args.context,
        **sizes,
        "read_gb_per_s": round(bandwidth / 1e9, 1),
        "floor_ms": round(total / bandwidth * 1e3, 2),
    }
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
