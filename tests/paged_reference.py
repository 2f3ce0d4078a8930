"""Reference pieces for the paged-attention kernel tests (real CUDA in test_cuda*.py, the CPU
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


def softmax_with_sinks(scores: torch.Tensor, sinks=None) -> torch.Tensor:
    """softmax over the last dim of scores [H, ..., L]; with `sinks` [H] (attention sinks,
    gpt-oss), each head's sink logit joins the denominator and is dropped after."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.double().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


def decode_reference(q, kv_cache, tables, lens, block_size, window=0, sinks=None) -> torch.Tensor:
    """float64 attention of q [S, H, D] over each sequence's gathered context (with a window
    W > 0, its last W positions; with `sinks` [H], each head's sink logit in the softmax)."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    group = q.shape[1] // num_kv_heads
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(max(0, n - window) if window > 0 else 0, n, device=q.device)
        slots = tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = flat[0, slots].double().repeat_interleave(group, dim=1)
        v = flat[1, slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), k) / math.sqrt(head_dim)
        out[s] = torch.einsum("hl,lhd->hd", softmax_with_sinks(scores, sinks), v)
    return out


def prefill_reference(q, kv_cache, tables, seqs, block_size, window=0, sinks=None) -> torch.Tensor:
    """float64 attention of each prefilling sequence's queries over its cached context.

    q [T, H, D] is the step's flat batch; `seqs` lists (first token, query count, context
    length) per sequence; query j sits at position ctx_len - q_len + j and sees the keys at or
    before it (with a window W > 0, only its last W). Rows of other tokens stay zero. `sinks`
    [H]: each head's attention sink logit in the softmax's denominator."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    group = q.shape[1] // num_kv_heads
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s, (first, q_len, ctx_len) in enumerate(seqs):
        # From the first key any of its queries sees: a released block is never gathered.
        first_key = max(0, ctx_len - q_len - window + 1) if window > 0 else 0
        pos = torch.arange(first_key, ctx_len, device=q.device)
        slots = tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = flat[0, slots].double().repeat_interleave(group, dim=1)
        v = flat[1, slots].double().repeat_interleave(group, dim=1)
        query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        diff = query_pos[:, None] - pos[None, :]
        visible = (diff >= 0) & ((diff < window) if window > 0 else True)
        rows = q[first : first + q_len].double()
        scores = torch.einsum("qhd,lhd->hql", rows, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        out[first : first + q_len] = torch.einsum("hql,lhd->qhd", probs, v)
    return out


def packed_prefills(pairs) -> tuple[list[tuple[int, int, int]], int]:
    """(first token, query count, context length) per (query count, context length) pair,
    laid out as a step's flat batch with one decode token before each prefill (so prefill
    rows start mid-batch); and the batch's token count."""
    seqs, first = [], 0
    for q_len, ctx_len in pairs:
        seqs.append((first + 1, q_len, ctx_len))
        first += 1 + q_len
    return seqs, first


def poison_released_blocks(kv_cache, tables, released, block_size) -> torch.Tensor:
    """A cache with one more block, all NaN, that the `released[i]` first positions of each
    sequence i now point to (as blocks a sliding window released): a kernel that reads any
    of them puts NaN in its output. Returns the new cache; `tables` change in place."""
    poison = kv_cache.shape[1]
    shape = list(kv_cache.shape)
    shape[1] = 1
    nan_block = torch.full(shape, float("nan"), dtype=kv_cache.dtype, device=kv_cache.device)
    for i, n in enumerate(released):
        tables[i, : n // block_size] = poison
    return torch.cat([kv_cache, nan_block], dim=1)
