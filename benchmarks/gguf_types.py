"""The GGUF kernel on every type it reads, against MKL on the fp32 copy (issue 20).

Per type: one [N, K] matrix of random blocks (Gemma 3 270M's gate/up shape, 4096 x 640, or
1024 wide for the K-quants' 256-value blocks), `cpu_kernels.gguf_linear` at 1, 2, 8 and 512
input rows vs `F.linear` on the dequantized fp32 copy, and the int8-activation kernel
(`--quantization gguf-int8`): median of REPEATS timings, and each kernel's speed-up over fp32
(fp32 time / kernel time: > 1 means the kernel is faster); i/k: the integer path's speed-up
over the float kernel, from which executor/kernels/gguf_arithmetic.py's FASTEST_INTEGER_ROWS
is read (run it with and without ZLLM_CPU_ISA=avx2).

    OMP_NUM_THREADS=2 python benchmarks/gguf_types.py            # ~1 min on 2 cores
    OMP_NUM_THREADS=2 python benchmarks/gguf_types.py --batch 1 2 4 8 16 64 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_files import random_blocks  # noqa: E402  (random K-quant blocks, sane scales)
from pooling_peers import timed  # noqa: E402  (the median of runs after a warm-up call)

from zllm.executor.kernels import cpu as cpu_kernels  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def blocks(rows: int, cols: int, ggml_type: T) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    try:
        q = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, ggml_type)
    except NotImplementedError:
        q = random_blocks((rows, cols), ggml_type, rng)
    ref = dequantize(q, ggml_type).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 8, 512])
    args = parser.parse_args()
    cpu_kernels.load()
    print(f"threads {torch.get_num_threads()}, N = {args.rows}")
    print(
        f"{'type':6} {'K':>5} {'bytes/w':>7} "
        + " ".join(
            f"{f'M={m} fp32 ms':>14} {'kernel':>7} {'int8':>7} {'i/k':>5}" for m in args.batch
        )
    )
    for ggml_type in TYPES:
        block, size = GGML_QUANT_SIZES[ggml_type]
        cols = 640 if block == 32 else 1024
        q, ref = blocks(args.rows, cols, ggml_type)
        cells = []
        for m in args.batch:
            x = torch.randn(m, cols)
            kernel = timed(
                lambda x=x, q=q, t=int(ggml_type): cpu_kernels.gguf_linear(x, q, t), args.repeats
            )
            int8 = timed(
                lambda x=x, q=q, t=int(ggml_type): cpu_kernels.gguf_linear_int8(x, q, t),
                args.repeats,
            )
            fp32 = timed(lambda x=x, ref=ref: F.linear(x, ref), args.repeats)
            cells.append(
                f"{fp32 * 1e3:14.3f} {fp32 / kernel:6.2f}x {fp32 / int8:6.2f}x {kernel / int8:5.2f}"
            )
        print(f"{ggml_type.name:6} {cols:5} {size / block:7.3f} " + " ".join(cells))


if __name__ == "__main__":
    main()
