"""A decoder stack described by role, for code that runs a whole stack without the model's
modules: the fused CPU decode step (executor/graphs/fused_decode.py) builds its C++ stack from
this, never from the model's class.

A model offering it has `decode_stack_parts() -> StackParts` (Llama's family, Gemma 3):
its dense pre-norm layers' norms, matmuls and attention layers, what differs per family
(Gemma 3's sandwich norms, its GeGLU, the local RoPE table of its sliding layers) as plain
fields. Every norm is one with `multiplier()` (layers/norms.py): what the normed rows are
multiplied by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from zllm.executor.layers.rope import RotaryEmbedding


class Norm(Protocol):
    def multiplier(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class LayerParts:
    """One layer: x + attention(attn_norm(x)), then + mlp(ffn_norm(.)); with sandwich norms,
    each sublayer's output normed again (post_attn_norm, post_ffn_norm) before its add."""

    attn_norm: Norm
    ffn_norm: Norm
    qkv: nn.Module  # the fused [q | k | v] projection
    o: nn.Module
    gate_up: nn.Module  # the fused [gate | up] projection
    down: nn.Module
    attention: nn.Module  # the attention backend's layer (its scale, its decode kernel)
    q_norm: Norm | None = None  # per query head, before RoPE (Qwen 3, Gemma 3)
    k_norm: Norm | None = None
    post_attn_norm: Norm | None = None  # sandwich norms (Gemma 3)
    post_ffn_norm: Norm | None = None
    local_rope: bool = False  # rotates by the stack's local table (a sliding layer)
    rope: bool = True  # False: a NoPE layer (no rotation at all)


@dataclass(frozen=True, slots=True)
class StackParts:
    """The layers in order, the final norm, and what is the same for every layer."""

    layers: list[LayerParts]
    final_norm: Norm
    activation: str  # the MLPs' act(gate) * up (layers/activations.py's names)
    rope: RotaryEmbedding
    local_rope: RotaryEmbedding | None = None  # sliding layers' table (Gemma 3), if any
    sandwich: bool = False  # every layer has post_attn_norm and post_ffn_norm
