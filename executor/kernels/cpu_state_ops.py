"""A hybrid model's state-layer ops on CPU (csrc/cpu/state_layers.cpp).

    gated_delta_decode_(q, k, v, g, beta, state, slots, tiled, gate, norm_weight, eps)
        the decode rows' one-token step of a Gated DeltaNet layer (gated_delta_rule.py
        recurrent_step's arithmetic) and its gated RMSNorm, each row's slot of `state`
        updated in place: one pass to read it and one to write it, where torch's ops gather
        the slots, make five passes and scatter them back
    causal_conv_decode_(x, conv, slots, weight, bias)
        the decode rows' step of a state layer's causal conv (SiLU after), each window moved
        on in place
    mamba2_decode_(x, B, C, dt, A, D, state, slots)
        the decode rows' one-token step of a Mamba-2 layer (mamba2_scan.py scan_step's
        arithmetic), each row's slot of `state` updated in place

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
    x: torch.Tensor,
    conv: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(conv + bias) [B, C] of one new row per sequence, x [B, C], after its window
    conv[slot] [C, K - 1]; weight [C, K], bias [C] or None; each window moved on by one in
    place."""
    if bias is not None:
        bias = bias.float().contiguous()
    return cpu_kernels.load().causal_conv_decode_(
        x.contiguous(), conv, slots, weight.contiguous(), bias
    )


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
    """out [rows, heads, head_dim] of x [rows, heads, head_dim], B and C [rows, groups,
    state_size], dt [rows, heads] (after softplus), A and D [heads]; state [slots, heads,
    state_size, head_dim] (rows `slots` updated in place)."""
    return cpu_kernels.load().mamba2_decode_(
        x.contiguous(), B.contiguous(), C.contiguous(), dt.contiguous(),
        A.float().contiguous(), D.float().contiguous(), state, slots,
    )  # fmt: skip
