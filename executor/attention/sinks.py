"""Attention with sinks, in torch: the reference path for layers that have them (gpt-oss).

A sink is a learned logit per query head that joins each query's softmax denominator and
carries no value: it takes probability mass from the keys, so a query may attend to "nothing"
(the output shrinks toward zero instead of being forced onto some key):

    out_h = sum_j  exp(s_hj) / (exp(sink_h) + sum_k exp(s_hk)) * v_j,   s_hj = scale * q_h . k_j

SDPA has no place for it (nor does FlashAttention's varlen call), so these layers attend by
the formula: scores, the sink column appended, softmax, the sink column dropped, times V, in
fp32 (fp64 for fp64 inputs) whatever the model's dtype, as the CPU and CUDA kernels do; query
rows are taken in slices so a long prompt's scores stay within SCORE_FLOATS floats.
"""

from __future__ import annotations

import sys

import torch

# Scores held at once (per slice of query rows): 64 MiB in fp32.
SCORE_FLOATS = 1 << 24


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """q [B, heads, Q, D] over k, v [B, kv_heads, L, D] -> [B, heads, Q, D] in q's dtype.

    `mask`: bool, True where attended, broadcastable to [B, heads, Q, L] (SDPA's shapes);
    None: causal with Q == L; torch's causal biases (causal_lower_right: the CUDA path's
    SDPA chunks) as they say. `sinks` [heads]: each head's sink logit.
    """
    batch, heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    keep = _as_bool_mask(mask, num_queries, num_keys, q.device)
    keep = _grouped(keep, kv_heads, group)  # [B or 1, KVH or 1, G or 1, Q, L]
    work = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 (tests)
    q5 = q.to(work).view(batch, kv_heads, group, num_queries, head_dim)
    k5, v5 = k.to(work).unsqueeze(2), v.to(work).unsqueeze(2)  # [B, KVH, 1, L, D]
    sink = sinks.to(work).view(1, kv_heads, group, 1, 1)
    out = q.new_empty(q5.shape, dtype=work)
    rows = max(1, SCORE_FLOATS // max(1, batch * heads * num_keys))
    for first in range(0, num_queries, rows):
        span = slice(first, min(first + rows, num_queries))
        scores = (q5[:, :, :, span] @ k5.transpose(-1, -2)) * scale
        part = keep[..., span, :] if keep.shape[-2] > 1 else keep
        scores = scores.masked_fill(~part, float("-inf"))
        sink_column = sink.expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1)[..., :-1]
        out[:, :, :, span] = probs @ v5
    return out.view(q.shape).to(q.dtype)


def _as_bool_mask(
    mask: torch.Tensor | None, num_queries: int, num_keys: int, device: torch.device
) -> torch.Tensor:
    """The mask as bool [..., Q, L]; causal ones (None, a CausalBias) made explicit: query i
    sees keys j <= i, or with the lower-right variant j <= i + L - Q."""
    # A CausalBias exists only once its module is imported (the CUDA path imports it):
    # importing it here would load torch._dynamo, 2-3 CPU-seconds of every executor's start.
    bias = sys.modules.get("torch.nn.attention.bias")
    causal_bias = bias is not None and isinstance(mask, bias.CausalBias)
    if mask is not None and not causal_bias:
        if mask.dtype != torch.bool:
            raise ValueError(f"attention with sinks takes bool masks, got {mask.dtype}")
        return mask
    lower_right = causal_bias and mask.variant == bias.CausalVariant.LOWER_RIGHT
    offset = num_keys - num_queries if lower_right else 0
    query_pos = torch.arange(num_queries, device=device)[:, None] + offset
    return torch.arange(num_keys, device=device)[None, :] <= query_pos


def _grouped(keep: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """A [..., Q, L] mask (2-D, or 4-D with 1 or `heads` heads) as 5-D over (KV head, group)."""
    if keep.dim() == 2:
        return keep[None, None, None]
    if keep.dim() != 4:
        raise ValueError(f"attention masks are 2-D or 4-D, got {keep.dim()}-D")
    if keep.shape[1] == 1:
        return keep.unsqueeze(2)
    return keep.view(keep.shape[0], kv_heads, group, *keep.shape[2:])
