"""The host's cost of a step's attention metadata, by rows (issue 41: at concurrency 256 the
GPU waits for the executor's Python, "inputs + metadata" 2.85 ms a step on an H100's host).

Builds `step_inputs.build_attention_metadata` for N running sequences (contexts of 100-300
tokens, one new token each; "mixed": one of them a 128-token chunk) with the CUDA and the
torch backends' metadata, on the CPU (the host's work is the same whichever device the
tensors then go to), and prints the median of 50 builds.

    python benchmarks/step_metadata.py [--rows 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
import warnings

import numpy as np
import torch

from zllm.executor.attention.backend import TORCH_ATTENTION
from zllm.executor.attention.cuda import CUDA_ATTENTION
from zllm.executor.attention.layer_groups import LayerAttention
from zllm.executor.step_inputs import build_attention_metadata, token_positions


def median_ms(backend, num_rows: int, chunk: int, repeats: int = 50) -> float:
    rng = np.random.default_rng(0)
    layout = types.SimpleNamespace(  # the fields of a RankLayout the build reads
        block_size=16,
        layer_attention=[LayerAttention(0, None)] * 2,
        attention=backend,
        device=torch.device("cpu"),
        config=types.SimpleNamespace(deterministic=False),
    )
    states, query_lens = [], []
    for i in range(num_rows):
        context = int(rng.integers(100, 300))
        new = chunk if chunk and i == 0 else 1
        table = [int(b) for b in rng.integers(1, 100_000, -(-(context + new) // 16))]
        states.append(types.SimpleNamespace(block_ids=[table], num_computed_tokens=context))
        query_lens.append(new)
    seq_lens = [st.num_computed_tokens + q for st, q in zip(states, query_lens, strict=True)]
    positions = token_positions(query_lens, seq_lens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_attention_metadata(layout, states, query_lens, seq_lens, positions)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # SDPA's notes about CPU kernels
    for backend in (CUDA_ATTENTION, TORCH_ATTENTION):
        for rows in args.rows:
            decode = median_ms(backend, rows, 0)
            mixed = median_ms(backend, rows, 128)
            print(
                f"{backend.name:6s} {rows:4d} rows: decode-only {decode:.3f} ms, mixed {mixed:.3f} ms"
            )


if __name__ == "__main__":
    main()
