"""A hybrid model's state-layer ops on CPU (csrc/cpu/state_layers.cpp).

    gated_delta_decode_(q, k, v, g, beta, state, slots, tiled, gate, norm_weight, eps)
        the decode rows' one-token step of a Gated DeltaNet layer (gated_delta_rule.py
        recurrent_step's arithmetic) and its gated RMSNorm, each row's slot of `state`
        updated in place: one pass to read it and one to write it, where torch's ops gather
        the slots, make five passes and scatter them back
    causal_conv_decode_(x, conv, slots, weight)
        the decode rows' step of the layer's causal conv (SiLU after), each window moved on
        in place

`usable(x)` as cpu_layer_ops': an fp32 CPU tensor with the CPU kernels on and built; the
layer runs torch otherwise (the reference, and every other device and dtype).
"""

from __future__ import annotations

import torch

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_layer_ops


def usable(x: torch.Tensor) -> bool:
    return cpu_layer_ops.usable(x)


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
    """out [B, heads, value_dim]; q, k [B, key_heads, key_dim] (not yet normalised), v
    [B, heads, value_dim], g and beta [B, heads], state [slots, heads, key_dim, value_dim]
    (rows `slots` [B] updated in place). With `gate` [B, heads, value_dim] and `norm_weight`
    [value_dim]: the output normed per head, times the weight and silu(gate)."""
    if gate is not None:
        gate = gate.float().contiguous()
        norm_weight = norm_weight.float().contiguous()
    return cpu_kernels.load().gated_delta_decode_(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        state, slots, tiled, gate, norm_weight, eps,
    )  # fmt: skip


def causal_conv_decode_(
    x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """silu(conv) [B, C] of one new row per sequence, x [B, C], after its window conv[slot]
    [C, K - 1]; weight [C, K]; each window moved on by one in place."""
    return cpu_kernels.load().causal_conv_decode_(x.contiguous(), conv, slots, weight.contiguous())
