"""The arithmetic of a Mamba-2 layer's state (Granite 4.0-H, Nemotron-H), in torch, fp32: the
selective scan one token at a time for decodes and a chunk at a time for prompts, and the
layer's gated group norm. transformers' torch implementations are the reference
(tests/executor/layers/test_mamba2_scan.py compares them); the causal conv before the scan is
causal_conv.py's.

Per head, with S the [state_size, head_dim] state, dt > 0 the head's step (softplus of its
projection plus dt_bias), A < 0 its decay rate, B and C the head's group's [state_size] rows:

    S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T
    y_t = S_t^T C_t + D x_t

a gated linear attention with query C, key B, value dt x and log decay g = dt A. A chunk of
c tokens after S_0, with G_t the chunk's running sum of g and L[t, s] = exp(G_t - G_s) for
s <= t (0 above the diagonal), takes three matmuls instead of c steps:

    y   = exp(G) C S_0 + (L * C B^T) (dt x) + D x
    S_c = exp(G_c) S_0 + (exp(G_c - G) B)^T (dt x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of a prompt (the [chunk, chunk] decay matrix per head).
CHUNK = 64


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [..., groups, state_size] -> [..., heads, state_size] (consecutive heads share
    a group, as transformers repeats them)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def scan_step(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of R sequences: x [R, H, P], B and C [R, groups, N], dt [R, H], A and D [H],
    state [R, H, N, P]. Returns (y [R, H, P], the new state)."""
    heads = x.shape[1]
    B, C = _per_head(B, heads), _per_head(C, heads)
    decay = (dt * A).exp()[..., None, None]
    state = state * decay + B.unsqueeze(-1) * (dt.unsqueeze(-1) * x).unsqueeze(-2)
    y = (C.unsqueeze(-2) @ state).squeeze(-2)
    return y + D.unsqueeze(-1) * x, state


def chunked_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L new tokens: x [L, H, P], B and C [L, groups, N], dt [L, H], A and D
    [H], state [H, N, P] before them. Returns (y [L, H, P], the state after them)."""
    heads = x.shape[1]
    skip = D.unsqueeze(-1) * x
    # Heads first: [H, L, P] and [H, L]; B and C per head a chunk at a time ([H, c, N]: the
    # whole prompt's would be L x H x N values each).
    v = (dt.unsqueeze(-1) * x).transpose(0, 1)
    g = (dt * A).t()
    length = x.shape[0]
    out = torch.empty_like(v)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        qc = _per_head(C[start:end], heads).transpose(0, 1)
        kc = _per_head(B[start:end], heads).transpose(0, 1)
        vc = v[:, start:end]
        size = end - start
        running = g[:, start:end].cumsum(-1)  # G [H, c]
        causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        decay = (running.unsqueeze(-1) - running.unsqueeze(-2)).masked_fill(~causal, -torch.inf)
        scores = decay.exp() * (qc @ kc.transpose(-1, -2))  # [H, c, c]
        out[:, start:end] = (qc * running.exp().unsqueeze(-1)) @ state + scores @ vc
        last = running[:, -1:]  # G_c [H, 1]
        state = (
            state * last.exp().unsqueeze(-1)
            + (kc * (last - running).exp().unsqueeze(-1)).transpose(-1, -2) @ vc
        )
    return out.transpose(0, 1) + skip, state


def gated_group_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba-2's norm of y [T, width] gated by gate [T, width]: y * silu(gate), RMS-normed
    over each of `groups` equal slices of the width, times weight [width]; fp32."""
    gated = y.float() * F.silu(gate.float())
    sliced = gated.view(*gated.shape[:-1], groups, -1)
    normed = sliced * torch.rsqrt(sliced.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * normed.view_as(gated)
