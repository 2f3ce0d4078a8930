"""The KV pool's stored form in torch (--kv-cache-dtype; formats in zllm/kv/kv_dtypes.py):
`narrow` turns new K/V into what the cache stores, `widen` turns what it stores back into
activations. The CPU kernels (csrc/cpu/paged_attention.h) read and write the same bits: an
int8 row is rounded exactly as `quantize_rows` rounds it (`store_row`), so the fused decode
step and the module path fill a cache identically.

    int8 row:  q[0..D) int8 | one bf16 scale per group of int8_group(D) values
               x ~= q * scale,  scale = bf16(absmax(group) / 127)
"""

from __future__ import annotations

import torch

from zllm.kv.kv_dtypes import INT8_MAX, int8_group


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., D] -> int8 rows [..., D + 2 D / group]: per group, the scale absmax / 127
    rounded to bf16, each value over it rounded to nearest even, then the groups' scales."""
    head_dim = x.shape[-1]
    group = int8_group(head_dim)
    groups = x.float().reshape(*x.shape[:-1], head_dim // group, group)
    scale = (groups.abs().amax(-1, keepdim=True) / INT8_MAX).to(torch.bfloat16).float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = torch.round(groups * inverse).clamp_(-INT8_MAX, INT8_MAX)
    rows = torch.empty((*x.shape[:-1], head_dim + 2 * (head_dim // group)), dtype=torch.int8)
    rows[..., :head_dim] = values.reshape(x.shape)
    rows[..., head_dim:].view(torch.bfloat16).copy_(scale.squeeze(-1))
    return rows


def dequantize_rows(
    rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """int8 rows [..., D + 2 D / group] -> [..., D] values q * scale. (head_dim is named:
    a row's width alone can fit two head_dims, e.g. 72 and 80.)"""
    group = int8_group(head_dim)
    scale = rows[..., head_dim:].contiguous().view(torch.bfloat16).float()
    values = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // group, group)
    return (values * scale[..., None]).reshape(*rows.shape[:-1], head_dim).to(dtype)


def narrow(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V as the cache stores it (16-bit: rounded to nearest even, as torch converts)."""
    return quantize_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def widen(stored: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """What the cache holds (rows of head_dim values), as `dtype` activations."""
    if stored.dtype == torch.int8:
        return dequantize_rows(stored, head_dim, dtype)
    return stored.to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x rounded as the cache would store it: a fresh prompt attends over the K/V later steps
    read back, so a prefix hit or a recompute sees the values a fresh run saw."""
    if cache_dtype == x.dtype:
        return x
    return widen(narrow(x, cache_dtype), x.dtype, x.shape[-1])
