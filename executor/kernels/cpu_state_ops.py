"""A hybrid model's state-layer ops on CPU (csrc/cpu/state_layers.cpp).

    gated_delta_decode_(q, k, v, g, beta, state, slots, tiled)
        the decode rows' one-token step of a Gated DeltaNet layer (gated_delta_rule.py
        recurrent_step's arithmetic), each row's slot of `state` updated in place: one pass
        to read it and one to write it, where torch's ops gather the slots, make five passes
        and scatter them back

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
) -> torch.Tensor:
    """out [B, heads, value_dim]; q, k [B, key_heads, key_dim] (not yet normalised), v
    [B, heads, value_dim], g and beta [B, heads], state [slots, heads, key_dim, value_dim]
    (rows `slots` [B] updated in place)."""
    return cpu_kernels.load().gated_delta_decode_(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        state, slots, tiled,
    )  # fmt: skip
