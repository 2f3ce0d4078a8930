"""A decoder layer's MLP by what the model's record says of that layer: a gated MLP, or a
mixture of experts (with Qwen2-MoE's, Qwen3-Next's shared expert beside it). Llama's family
and the hybrids (executor/models/) build their layers' MLPs here.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.model.arch_config import ModelArchConfig


def make_mlp(
    arch: ModelArchConfig, layer: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> nn.Module:
    """Layer `layer`'s MLP: dense, or a mixture of experts (with Qwen2-MoE's shared expert)."""
    if not arch.is_moe_layer(layer):
        return GatedMLP(arch, dtype, tp)
    if tp.enabled:  # zllm/config/parallel.py refuses it first; a model built directly too
        raise ValueError("tensor parallelism does not split mixture-of-experts layers yet")
    shared = arch.moe.shared_expert_intermediate_size
    shared_expert = GatedMLP(arch, dtype, tp, intermediate_size=shared) if shared else None
    return MoEBlock(arch, dtype, shared_expert=shared_expert)
