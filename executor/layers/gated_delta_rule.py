"""The arithmetic of a Gated DeltaNet layer's state (Qwen3-Next, Qwen3.5), in torch, fp32:
the gated delta rule (the causal conv before it is causal_conv.py's), one token at a time for
decodes and a chunk at a time for prompts. transformers' torch implementations are the
reference (tests/executor/layers/test_gated_delta_rule.py compares them).

The rule, per value head, with S the [key_dim, value_dim] state and g <= 0 the log decay:

    S_t   = exp(g_t) S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
    o_t   = S_t^T q_t                        (q, k L2-normalised; q scaled by key_dim^-1/2)

A chunk of c tokens after a state S_0 takes a few matmuls instead of c steps. With G_t the
chunk's running sum of g and D[t, s] = exp(G_t - G_s) for s <= t (0 above the diagonal),
the d_t solve one unit lower-triangular system (I + A) d = beta (v - exp(G) k S_0) with
A[t, s] = beta_t D[t, s] k_t . k_s below the diagonal; then

    o   = exp(G) q S_0 + (D * q k^T) d
    S_c = exp(G_c) S_0 + (exp(G_c - G) k)^T d
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of a prompt: the triangular system is chunk x chunk per head.
CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's and transformers')."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, num_heads: int, tiled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., key_heads, key_dim] normalised, q scaled, each key head repeated for the
    value heads it serves: [..., num_heads, key_dim]. Consecutive value heads share a key
    head, or with `tiled` (llama.cpp's Qwen3.5 files) value head h reads key head
    h % key_heads."""
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    groups = num_heads // q.shape[-2]
    if groups > 1 and tiled:
        repeat = [1] * (q.dim() - 2) + [groups, 1]
        q, k = q.repeat(*repeat), k.repeat(*repeat)
    elif groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, key_heads, key_dim], v [B, H, value_dim], g and
    beta [B, H], state [B, H, key_dim, value_dim]. Returns (out [B, H, value_dim], the new
    state)."""
    q, k = _prepare(q, k, v.shape[1], tiled)
    state = state * g.exp()[..., None, None]
    remembered = (k.unsqueeze(-2) @ state).squeeze(-2)  # [B, H, value_dim]: S^T k
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tiled: bool = False,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L new tokens: q, k [L, key_heads, key_dim], v [L, H, value_dim], g and
    beta [L, H], state [H, key_dim, value_dim] before them. Returns (out [L, H, value_dim],
    the state after them); `tiled`: as _prepare's."""
    q, k = _prepare(q, k, v.shape[1], tiled)
    # Heads first: [H, L, dim] and [H, L].
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.t(), beta.t()
    length = v.shape[1]
    out = torch.empty_like(v)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        size = end - start
        running = g[:, start:end].cumsum(-1)  # G [H, c]
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = (running.unsqueeze(-1) - running.unsqueeze(-2)).masked_fill(~causal, -torch.inf)
        decay = decay.exp()  # D [H, c, c]
        lower = (bc.unsqueeze(-1) * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        system = lower + torch.eye(size, dtype=q.dtype, device=q.device)
        rhs = torch.cat((vc, kc * running.exp().unsqueeze(-1)), dim=-1) * bc.unsqueeze(-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        values, decayed_keys = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        delta = values - decayed_keys @ state  # d [H, c, value_dim]
        out[:, start:end] = (qc * running.exp().unsqueeze(-1)) @ state + (
            decay * (qc @ kc.transpose(-1, -2))
        ) @ delta
        last = running[:, -1:]  # G_c [H, 1]
        state = (
            state * last.exp().unsqueeze(-1)
            + (kc * (last - running).exp().unsqueeze(-1)).transpose(-1, -2) @ delta
        )
    return out.transpose(0, 1), state


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Per value head: rms_norm(x) * weight * silu(gate), fp32 (transformers' order: the
    normed rows in the model's dtype times the weight, then the gate in fp32)."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(weight.dtype)).float() * F.silu(gate.float())
