"""A mixture-of-experts layer's chosen experts on the GPU (csrc/moe_experts.cu), with no
host synchronisation: the per-expert path (executor/layers/moe/) reads each expert's token
count on the host, which a CUDA graph cannot capture and which costs a sync per layer.

    expert_groups(experts, num_experts)   the (token, expert) pairs grouped by expert, on the
                                          device: order, offsets, expert_list
    moe_gemv(x, weight, bias, groups, pair_div)   every pair's row through its expert's
                                          matrix [E, out, in]; rows in pair order

A step's pair p = t * k + j (token t's j-th expert) reads x[p // pair_div] (pair_div = k for
the layer's input, 1 for the gate_up output the down projection reads) and writes out[p], so
the combine is a reshape to [T, k, hidden] and a weighted sum, with no scatter.

`usable(x)` says whether a tensor takes this path: a CUDA tensor of at most MAX_TOKENS
tokens (or any count while a graph is being captured), unless ZLLM_CUDA_MOE=0 (A/B runs;
MoE models then replay no CUDA graphs). Past MAX_TOKENS (prefills), torch's per-expert
matmuls on the tensor cores do better than a warp per output row. Planning yields
KernelLaunch records, which the CPU tests run through the kernel emulator (csrc/emu).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from zllm.executor.kernels.cuda import (
    _DTYPE_TAG,
    CudaKernelError,
    KernelLaunch,
    _aligned16,
    _ptr,
    run_launches,
)

SOURCE = "moe_experts.cu"
THREADS = 128  # csrc/moe_experts.cu kMoeThreads
ROWS_PER_BLOCK = 8  # ... kMoeRowsPerBlock: output rows of one thread block
# Tokens up to which a step's experts take the kernel (decode steps, and the decode graphs'
# largest batch, 256); prefills take torch's per-expert matmuls.
MAX_TOKENS = 256

ENABLED = os.environ.get("ZLLM_CUDA_MOE", "1") != "0"


def usable(x: torch.Tensor) -> bool:
    if not (ENABLED and x.is_cuda):
        return False
    return x.shape[0] <= MAX_TOKENS or torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """The pairs of a step grouped by expert, all int64 tensors on the device."""

    order: torch.Tensor  # [P] pair indices sorted by expert (stable)
    offsets: torch.Tensor  # [E + 1] expert e's pairs: order[offsets[e]:offsets[e + 1]]
    expert_list: torch.Tensor  # [E] the experts with pairs first
    num_pairs: int


def expert_groups(experts: torch.Tensor, num_experts: int) -> ExpertGroups:
    """The (token, expert) pairs of experts [T, k] grouped by expert, in torch ops that stay
    on the device (sort, searchsorted), so nothing waits for the GPU."""
    pairs = experts.reshape(-1)
    chosen, order = torch.sort(pairs, stable=True)
    bounds = torch.arange(num_experts + 1, device=pairs.device, dtype=chosen.dtype)
    offsets = torch.searchsorted(chosen, bounds)
    empty = (offsets[1:] == offsets[:-1]).to(torch.int8)
    expert_list = torch.sort(empty, stable=True)[1]  # experts with pairs first, in id order
    return ExpertGroups(order, offsets, expert_list, pairs.numel())


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 3 or not weight.is_contiguous() or weight.dtype not in _DTYPE_TAG:
        raise CudaKernelError(
            f"expert weights must be a contiguous fp32/fp16/bf16 [experts, out, in] tensor, "
            f"got {weight.dtype} {list(weight.shape)}"
        )
    if not _aligned16(weight, weight.shape[2]):
        raise CudaKernelError(
            f"the expert kernel reads rows in 16-byte packs: in_features={weight.shape[2]} "
            f"{weight.dtype} values are not a multiple of 16 bytes"
        )


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_weight(weight)
    num_experts, out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != weight.dtype or x.stride(1) != 1:
        raise CudaKernelError(
            f"x must be {weight.dtype} [rows, {in_features}] with contiguous rows, "
            f"got {x.dtype} {list(x.shape)}"
        )
    if not _aligned16(x, x.stride(0)):
        raise CudaKernelError("x must be 16-byte aligned with a row stride of 16-byte multiples")
    if bias is not None and (
        tuple(bias.shape) != (num_experts, out_features)
        or bias.dtype != weight.dtype
        or not bias.is_contiguous()
    ):
        raise CudaKernelError(f"bias must be a contiguous [{num_experts}, {out_features}] tensor")


def takes(x: torch.Tensor | None, weight: torch.Tensor | None) -> bool:
    """Whether moe_gemv reads x (None: a fresh contiguous tensor of the right width) and
    weight as they are (the model's usual layouts do)."""
    if weight is None:
        return False
    try:
        _check_weight(weight)
        if x is not None:
            _check_operands(x, weight, None)
    except CudaKernelError:
        return False
    return True


def plan_moe_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    groups: ExpertGroups,
    pair_div: int,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    """The launch writing out[p] = weight[e(p)] @ x[p // pair_div] (+ bias[e(p)])."""
    _check_operands(x, weight, bias)
    num_experts, out_features, in_features = weight.shape
    pairs = groups.num_pairs
    if tuple(out.shape) != (pairs, out_features) or not out.is_contiguous():
        raise CudaKernelError(f"out must be a contiguous [{pairs}, {out_features}] tensor")
    if out.dtype != weight.dtype:
        raise CudaKernelError(f"out must be {weight.dtype}, got {out.dtype}")
    if pair_div < 1 or pairs > x.shape[0] * pair_div:
        raise CudaKernelError(f"{pairs} pairs do not read {x.shape[0]} rows {pair_div} apiece")
    if pairs == 0:
        return []
    index = (groups.order, groups.offsets, groups.expert_list)
    for name, t in zip(("order", "offsets", "expert_list"), index, strict=True):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise CudaKernelError(f"{name} must be a contiguous int64 tensor")
    args = (
        _ptr(out),
        _ptr(x),
        np.int64(x.stride(0)),
        np.int32(pair_div),
        _ptr(weight),
        _ptr(bias),
        *map(_ptr, index),
        np.int32(out_features),
        np.int32(in_features),
    )
    grid = (-(-out_features // ROWS_PER_BLOCK), min(pairs, num_experts), 1)
    name = f"zllm_moe_gemv<{_DTYPE_TAG[weight.dtype]}>"
    return [KernelLaunch(SOURCE, name, grid, (THREADS, 1, 1), args, index)]


def moe_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    groups: ExpertGroups,
    pair_div: int,
) -> torch.Tensor:
    """[pairs, out]: each pair's row of x through its expert's matrix."""
    out = torch.empty(groups.num_pairs, weight.shape[1], dtype=weight.dtype, device=x.device)
    run_launches(plan_moe_gemv(x, weight, bias, groups, pair_div, out), x.device)
    return out
