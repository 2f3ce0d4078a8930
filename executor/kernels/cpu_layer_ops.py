"""A decoder layer's row-wise ops on CPU (csrc/cpu/row_ops.h): RMSNorm with its residual add,
RoPE in place, SiLU/GeGLU-and-mul, one C++ call each where torch's eager ops take 6, 7 and 2.

    rms_norm(x, residual, weight, eps) -> (normed, x + residual)   models/*.py norms
    rope_(qk, cos, sin)                  rotates q and k in place   models/*.py apply_rope
    gated_act(gate_up, activation)       act(gate) * up             models/*.py MLPs

The fused decode step (decode_stack.h) runs the same functions, so a step gives the same bits
on either path. `usable(x)` says whether a tensor takes them: an fp32 CPU tensor when the CPU
kernels are on (not with ZLLM_CPU_KERNELS=0) and build (the first call builds them if the
engine has not yet, once per machine); otherwise the model code runs torch
(the reference, and every other device and dtype). Each op returns None for a layout it does
not read, and the caller falls back to torch.
"""

from __future__ import annotations

import functools

import torch

from zllm.executor.kernels import cpu as cpu_kernels

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # row_ops.h's Activation


@functools.cache
def _available() -> bool:
    if not (cpu_kernels.enabled() and cpu_kernels.cpu_supports_kernels()):
        return False
    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelError:
        return False  # the attention backend already warned; torch serves
    return True


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _available()


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * norm(x + residual), x + residual) over the last dim of a [T, n] or
    [T, heads, n] tensor; (weight * norm(x), x) without a residual."""
    if x.stride(-1) != 1 or x.dim() not in (2, 3) or weight.dtype != torch.float32:
        return None
    if residual is not None and residual.stride(-1) != 1:
        return None
    return cpu_kernels.load().rms_norm_rows(x, residual, weight.contiguous(), eps)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotates qk [T, heads, D] in place with cos, sin [T, 1, rotary_dim / 2] and returns it."""
    if qk.dim() != 3 or qk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return None
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return None
    return cpu_kernels.load().rope_rows_(qk, cos, sin)


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
    """act(gate) * up of the fused [T, gate | up] projection; None for an activation or
    layout it does not compute."""
    if activation not in ACTIVATIONS or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return None
    return cpu_kernels.load().gated_activation_rows(gate_up, ACTIVATIONS[activation])
