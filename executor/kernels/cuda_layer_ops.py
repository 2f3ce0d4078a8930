"""Fused row-wise ops of a Llama-family layer on the GPU (csrc/layer_ops.cu): one kernel each
for RMSNorm (with the residual add), RoPE and SiLU-and-mul, where torch's eager ops launch
9, 7 and 2 small kernels. At batch 1 launches are what a decode step's time goes to, so
this is most of the gap between a step and its kernels' real work (BENCHMARKS.md).

    rms_norm(x, residual, weight, eps) -> (normed, x + residual)   models/llama.py RMSNorm
    rope_(qk, cos, sin)                  rotates q and k in place   layers/rope.py apply_rope
    rope_cache_(qk, v, cos, sin, cache, slots)   the same, and k, v into the KV cache
                                         (the attention layer then skips its write)
    silu_mul(gate_up)                    silu(gate) * up            layers/activations.py

`usable(x)` says whether a tensor takes the fused path: a CUDA tensor, unless
ZLLM_CUDA_LAYER_OPS=0 (A/B measurements) or the layout is one these kernels do not read
(each op names its own condition). The model code calls torch otherwise, so the CPU path
is untouched. Planning, as in cuda_kernels.py, yields KernelLaunch records that the CPU
tests run through the kernel emulator.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from zllm.executor.kernels.cuda import (
    _DTYPE_TAG,
    CudaKernelError,
    KernelLaunch,
    _check_cache,
    _ptr,
    run_launches,
)

SOURCE = "layer_ops.cu"
MAX_THREADS = 1024  # csrc/layer_ops.cu's kMaxThreads
SILU_THREADS = 256  # columns per SiLU-and-mul block


def threads_for(work: int, per_thread: int) -> int:
    """Threads for a row of `work` items, about `per_thread` each: a power of two, 32 to
    MAX_THREADS (a whole warp at least; a big row spread over many warps, not looped over)."""
    threads = 32
    while threads < MAX_THREADS and threads * per_thread < work:
        threads *= 2
    return threads


ENABLED = os.environ.get("ZLLM_CUDA_LAYER_OPS", "1") != "0"
# RoPE and the KV cache write in one kernel (ZLLM_CUDA_ROPE_CACHE=0: two, for A/B runs).
ROPE_CACHE = os.environ.get("ZLLM_CUDA_ROPE_CACHE", "1") != "0"


def usable(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of a 2-D tensor with contiguous rows; None for other layouts."""
    if x.dim() != 2 or x.stride(1) != 1:
        return None
    return x.shape[0], x.stride(0)


# ---- planning ------------------------------------------------------------------------------
def plan_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    sum_out: torch.Tensor | None,
) -> list[KernelLaunch]:
    rows = _rows(x)
    if rows is None:
        raise CudaKernelError("rms_norm takes [rows, hidden] with contiguous rows")
    num_rows, stride = rows
    hidden = x.shape[1]
    for name, t in (("out", out), ("residual", residual), ("sum_out", sum_out)):
        if t is not None and (tuple(t.shape) != tuple(x.shape) or not t.is_contiguous()):
            raise CudaKernelError(f"{name} must be a contiguous [{num_rows}, {hidden}] tensor")
    if (residual is None) != (sum_out is None):
        raise CudaKernelError("residual and sum_out go together")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise CudaKernelError(f"weight must be a contiguous [{hidden}] tensor")
    if num_rows == 0:
        return []
    args = (
        _ptr(out),
        _ptr(sum_out),
        _ptr(x),
        np.int64(stride),
        _ptr(residual),
        _ptr(weight),
        np.int32(hidden),
        np.float32(eps),
    )
    name = f"zllm_rms_norm<{_DTYPE_TAG[x.dtype]}>"
    block = (threads_for(hidden, 4), 1, 1)
    return [KernelLaunch(SOURCE, name, (num_rows, 1, 1), block, args)]


def _rope_layout(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
    """(token stride, head stride, cos/sin row stride) when the kernel reads this layout."""
    if qk.dim() != 3 or qk.stride(2) != 1 or cos.shape != sin.shape:
        return None
    half = cos.shape[-1]
    if cos.dim() != 3 or cos.shape[0] != qk.shape[0] or cos.shape[1] != 1 or 2 * half > qk.shape[2]:
        return None
    if cos.stride(2) != 1 or sin.stride(2) != 1 or cos.stride(0) != sin.stride(0):
        return None
    return qk.stride(0), qk.stride(1), cos.stride(0)


def plan_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[KernelLaunch]:
    layout = _rope_layout(qk, cos, sin)
    if layout is None:
        raise CudaKernelError("rope takes qk [T, heads, D] and cos/sin [T, 1, rot/2]")
    token_stride, head_stride, cs_stride = layout
    if qk.shape[0] == 0:
        return []
    args = (
        _ptr(qk),
        np.int64(token_stride),
        np.int64(head_stride),
        np.int32(qk.shape[1]),
        np.int32(cos.shape[-1]),
        _ptr(cos),
        _ptr(sin),
        np.int64(cs_stride),
    )
    name = f"zllm_rope<{_DTYPE_TAG[qk.dtype]}>"
    block = (threads_for(qk.shape[1] * cos.shape[-1], 2), 1, 1)
    return [KernelLaunch(SOURCE, name, (qk.shape[0], 1, 1), block, args)]


def _rope_cache_usable(
    qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor, slots
) -> bool:
    """Whether zllm_rope_cache reads these: the RoPE layout, v [T, kv_heads, head_dim] with
    contiguous heads, a cache of qk's dtype with v's heads, int64 slots, one device."""
    return (
        v.dim() == 3
        and v.stride(2) == 1
        and v.shape[0] == qk.shape[0]
        and v.shape[2] == qk.shape[2]
        and 0 < v.shape[1] < qk.shape[1]
        and kv_cache.dim() == 5
        and kv_cache.is_contiguous()
        and kv_cache.dtype == qk.dtype == v.dtype
        and tuple(kv_cache.shape[3:]) == tuple(v.shape[1:])
        and slots.dtype == torch.int64
        and tuple(slots.shape) == (qk.shape[0],)
        and slots.is_contiguous()
        and len({qk.device, v.device, cos.device, kv_cache.device, slots.device}) == 1
    )


def plan_rope_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[KernelLaunch]:
    layout = _rope_layout(qk, cos, sin)
    if layout is None or not _rope_cache_usable(qk, v, cos, kv_cache, slot_mapping):
        raise CudaKernelError(
            "rope_cache takes qk [T, heads + kv_heads, D], v [T, kv_heads, D], cos/sin "
            "[T, 1, rot/2], a contiguous cache of their dtype and int64 slots [T]"
        )
    token_stride, head_stride, cs_stride = layout
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(kv_cache)
    if qk.shape[0] == 0:
        return []
    args = (
        _ptr(qk),
        np.int64(token_stride),
        np.int64(head_stride),
        np.int32(qk.shape[1] - num_kv_heads),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int32(cos.shape[-1]),
        _ptr(cos),
        _ptr(sin),
        np.int64(cs_stride),
        _ptr(v),
        np.int64(v.stride(0)),
        np.int64(v.stride(1)),
        _ptr(kv_cache),
        _ptr(slot_mapping),
        np.int64(num_blocks * block_size),
    )
    name = f"zllm_rope_cache<{_DTYPE_TAG[qk.dtype]}>"
    block = (threads_for(qk.shape[1] * cos.shape[-1], 2), 1, 1)
    return [KernelLaunch(SOURCE, name, (qk.shape[0], 1, 1), block, args)]


def plan_silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> list[KernelLaunch]:
    rows = _rows(gate_up)
    if rows is None or gate_up.shape[1] % 2:
        raise CudaKernelError("silu_mul takes [rows, 2 * inter] with contiguous rows")
    num_rows, stride = rows
    inter = gate_up.shape[1] // 2
    if tuple(out.shape) != (num_rows, inter) or not out.is_contiguous():
        raise CudaKernelError(f"out must be a contiguous [{num_rows}, {inter}] tensor")
    if num_rows == 0:
        return []
    args = (_ptr(out), _ptr(gate_up), np.int64(stride), np.int32(inter))
    name = f"zllm_silu_mul<{_DTYPE_TAG[gate_up.dtype]}>"
    threads = min(SILU_THREADS, threads_for(inter, 1))
    grid = (num_rows, -(-inter // threads), 1)
    return [KernelLaunch(SOURCE, name, grid, (threads, 1, 1), args)]


# ---- the ops -------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * norm(x + residual), x + residual), as models/llama.py RMSNorm returns them;
    None when x's layout is not [rows, hidden] with contiguous rows (the caller uses torch)."""
    if _rows(x) is None or (residual is not None and not residual.is_contiguous()):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sum_out = None if residual is None else torch.empty_like(out)
    run_launches(plan_rms_norm(x, residual, weight, eps, out, sum_out), x.device)
    return out, (x if sum_out is None else sum_out)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotates qk ([T, heads, D], heads strided as they lie in the fused qkv output) in place
    and returns it; None when the layout is not one the kernel reads."""
    if _rope_layout(qk, cos, sin) is None:
        return None
    run_launches(plan_rope(qk, cos, sin), qk.device)
    return qk


def rope_cache_(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Rotates qk's q and k heads in place and writes k and v at their cache slots, in one
    kernel; False (nothing done) when a layout is not one the kernel reads."""
    if not ROPE_CACHE or _rope_layout(qk, cos, sin) is None:
        return False
    if not _rope_cache_usable(qk, v, cos, kv_cache, slot_mapping):
        return False
    run_launches(plan_rope_cache(qk, v, cos, sin, kv_cache, slot_mapping), qk.device)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of the fused [rows, gate | up] projection; None for other layouts."""
    if _rows(gate_up) is None or gate_up.shape[1] % 2:
        return None
    out = torch.empty(
        (gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device
    )
    run_launches(plan_silu_mul(gate_up, out), gate_up.device)
    return out
