"""The causal depthwise conv1d a state layer runs before its recurrence (Gated DeltaNet's over
q|k|v, Mamba-2's over x|B|C), then SiLU, with each sequence's rolling window of its last
kernel - 1 inputs in its slot of the state pool (executor/kv/state_pool.py). fp32; torch here,
the one-input step of csrc/cpu/state_layers.cpp or csrc/state_layers.cu for a step's decode
rows (executor/kernels/state_ops.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from zllm.executor.kv.state_pool import LayerState
from zllm.executor.kv.state_step import StateStep, pieces


def conv_prefill(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new rows x [L, C] through the depthwise causal conv (weight [C, K],
    `bias` [C] or None) after its window [C, K - 1] (the inputs before them; zeros for a
    fresh sequence), then SiLU. Returns (out [L, C], the window after them [C, K - 1])."""
    channels, kernel = weight.shape
    inputs = torch.cat((window, x.t()), dim=1)  # [C, K - 1 + L]
    out = F.conv1d(inputs.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0]
    return F.silu(out).t(), inputs[:, inputs.shape[1] - (kernel - 1) :]


def conv_decode(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row per sequence, x [B, C], after windows [B, C, K - 1]: (out [B, C], the
    windows moved on by one [B, C, K - 1])."""
    inputs = torch.cat((windows, x.unsqueeze(2)), dim=2)  # [B, C, K]
    out = (inputs * weight).sum(-1)
    return F.silu(out if bias is None else out + bias), inputs[:, :, 1:]


def step_conv(
    mixed: torch.Tensor,
    cache: LayerState,
    step: StateStep,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ops: ModuleType | None,
) -> torch.Tensor:
    """SiLU(causal conv) of a step's rows [T, C] (fp32), each sequence after its window, the
    windows moved on (and a prefix-cache save's taken where it falls). `ops`: the kernels
    that take the decode rows (state_ops.decode_ops), None for torch's."""
    rows, slots = step.decode_rows, step.decode_slots
    if not step.prefill_seqs and ops is not None:  # decodes only: every row in order
        return ops.causal_conv_decode_(mixed, cache.conv, slots, weight, bias)
    conv_out = torch.empty_like(mixed)
    if step.decode_seqs and ops is not None:
        conv_out[rows] = ops.causal_conv_decode_(mixed[rows], cache.conv, slots, weight, bias)
    elif step.decode_seqs:
        out, windows = conv_decode(mixed[rows], cache.conv[slots], weight, bias)
        conv_out[rows] = out
        cache.conv[slots] = windows
    bounds = step.query_start
    for i in step.prefill_seqs:
        window = cache.conv[step.slots[i]]
        for start, end, snapshot in pieces(bounds[i], bounds[i + 1], step.saves.get(i)):
            conv_out[start:end], window = conv_prefill(mixed[start:end], window, weight, bias)
            if snapshot is not None:
                cache.snap_conv[snapshot] = window
        cache.conv[step.slots[i]] = window
    return conv_out
