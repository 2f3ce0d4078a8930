"""A hybrid model's state-layer decode steps on the GPU (csrc/state_layers.cu), the CUDA
counterpart of cpu_state_ops: each decode row's slot of the state pool read once and updated
in place by one launch, where torch's eager ops gather the slots, pass over them several
times and scatter them back.

    causal_conv_decode_(x, conv, slots, weight, bias)   the causal conv's one-input step
    gated_delta_decode_(q, k, v, g, beta, state, slots, tiled, gate, norm_weight, eps)
                                                        Gated DeltaNet's one-token step (q, k
                                                        normalised here; the gated norm after
                                                        it in torch)
    mamba2_decode_(x, B, C, dt, A, D, state, slots)     Mamba-2's one-token step

`usable(x)`: a CUDA tensor (the steps take fp32 copies of their inputs; the state pool is
fp32), unless ZLLM_CUDA_STATE_OPS=0 (A/B runs). Planning yields KernelLaunch records, which the CPU tests
run through the kernel emulator (csrc/emu).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from zllm.executor.kernels.cuda import CudaKernelError, KernelLaunch, _ptr, run_launches

SOURCE = "state_layers.cu"
THREADS = 128  # csrc/state_layers.cu kStateThreads

ENABLED = os.environ.get("ZLLM_CUDA_STATE_OPS", "1") != "0"


def usable(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def _check(slots: torch.Tensor, rows: int, **tensors: torch.Tensor) -> None:
    if slots.dtype != torch.int64 or tuple(slots.shape) != (rows,) or not slots.is_contiguous():
        raise CudaKernelError(f"slots must be a contiguous int64 [{rows}] tensor")
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise CudaKernelError(f"{name} must be a contiguous fp32 tensor, got {t.dtype}")


def _grid(work: int) -> tuple[int, int, int]:
    return (max(1, -(-work // THREADS)), 1, 1)


def plan_causal_conv_decode(
    x: torch.Tensor,
    conv: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    rows, channels = x.shape
    kernel = weight.shape[1]
    _check(slots, rows, x=x, conv=conv, weight=weight, out=out)
    if tuple(conv.shape[1:]) != (channels, kernel - 1) or tuple(out.shape) != (rows, channels):
        raise CudaKernelError(f"conv must be [slots, {channels}, {kernel - 1}], out [{rows}, {channels}]")  # fmt: skip
    if bias is not None:
        _check(slots, rows, bias=bias)
    args = (
        _ptr(out), _ptr(x), _ptr(conv), _ptr(slots), _ptr(weight), _ptr(bias),
        np.int64(rows), np.int32(channels), np.int32(kernel),
    )  # fmt: skip
    return [KernelLaunch(SOURCE, "zllm_causal_conv_decode", _grid(rows * channels), (THREADS, 1, 1), args)]  # fmt: skip


def causal_conv_decode_(
    x: torch.Tensor,
    conv: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(conv + bias) [B, C] of one new row per sequence after its window conv[slot]
    [C, K - 1]; each window moved on by one in place."""
    x, weight = x.contiguous(), weight.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty_like(x)
    run_launches(plan_causal_conv_decode(x, conv, slots, weight, bias, out), x.device)
    return out


def plan_gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    tiled: bool,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    """q and k as the rule reads them (L2-normalised, q scaled)."""
    rows, key_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    _check(slots, rows, q=q, k=k, v=v, g=g, beta=beta, state=state, out=out)
    if heads % key_heads or tuple(state.shape[1:]) != (heads, key_dim, value_dim):
        raise CudaKernelError(f"state must be [slots, {heads}, {key_dim}, {value_dim}]")
    args = (
        _ptr(out), _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(state), _ptr(slots),
        np.int64(rows), np.int32(heads), np.int32(key_heads), np.int32(key_dim),
        np.int32(value_dim), np.int32(int(tiled)),
    )  # fmt: skip
    grid = _grid(rows * heads * value_dim)
    return [KernelLaunch(SOURCE, "zllm_gated_delta_decode", grid, (THREADS, 1, 1), args)]


def gated_delta_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    tiled: bool,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """cpu_state_ops.gated_delta_decode_'s contract on the GPU: out [B, heads, value_dim]."""
    # (the FLA library's and transformers' l2norm, eps 1e-6, as the CPU kernel)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v)
    run_launches(plan_gated_delta_decode(q, k, v, g, beta, state, slots, tiled, out), v.device)
    if gate is None:
        return out
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight.float() * normed * F.silu(gate.float())


def plan_mamba2_decode(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    rows, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    _check(slots, rows, x=x, B=B, C=C, dt=dt, A=A, D=D, state=state, out=out)
    if heads % groups or tuple(state.shape[1:]) != (heads, state_size, head_dim):
        raise CudaKernelError(f"state must be [slots, {heads}, {state_size}, {head_dim}]")
    args = (
        _ptr(out), _ptr(x), _ptr(B), _ptr(C), _ptr(dt), _ptr(A), _ptr(D), _ptr(state),
        _ptr(slots), np.int64(rows), np.int32(heads), np.int32(head_dim), np.int32(groups),
        np.int32(state_size),
    )  # fmt: skip
    grid = _grid(rows * heads * head_dim)
    return [KernelLaunch(SOURCE, "zllm_mamba2_decode", grid, (THREADS, 1, 1), args)]


def mamba2_decode_(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """cpu_state_ops.mamba2_decode_'s contract on the GPU: out [B, heads, head_dim]."""
    x, B, C, dt, A, D = (t.float().contiguous() for t in (x, B, C, dt, A, D))
    out = torch.empty_like(x)
    run_launches(plan_mamba2_decode(x, B, C, dt, A, D, state, slots, out), x.device)
    return out
