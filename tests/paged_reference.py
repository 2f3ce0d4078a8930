"""Reference pieces for the paged-attention kernel tests (real CUDA in test_cuda.py, the CPU
emulator of the same kernels in test_csrc_compile.py): random block tables and a float64
decode attention to compare against."""

from __future__ import annotations

import math

import torch

# Largest relative error allowed against the float64 reference, per dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_tables(lens, block_size, gen, dtype=torch.int32, spare=3):
    """Block tables drawn from a shuffled pool (non-contiguous), `spare` blocks left unowned."""
    counts = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(counts) + spare
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(counts), dtype=dtype)
    start = 0
    for i, c in enumerate(counts):
        tables[i, :c] = pool[start : start + c]
        start += c
    return num_blocks, tables


def decode_reference(q, kv_cache, tables, lens, block_size) -> torch.Tensor:
    """float64 attention of q [S, H, D] over each sequence's gathered context."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    group = q.shape[1] // num_kv_heads
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = flat[0, slots].double().repeat_interleave(group, dim=1)
        v = flat[1, slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), k) / math.sqrt(head_dim)
        out[s] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out
