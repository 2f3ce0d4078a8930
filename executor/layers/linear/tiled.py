"""`--deterministic`: every matmul module of a model in calls of exactly TILE_ROWS rows
(executor/kernels/batch_invariant.py says why), and a mixture of experts' expert matrices
tiled the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.kernels.batch_invariant import TILE_ROWS, tiled
from zllm.executor.layers.linear.dense import DENSE_LINEAR_TYPES
from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear


class Tiled(nn.Module):
    """A matmul module (nn.Linear, GGUFLinear) whose every call sees TILE_ROWS rows."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = tiled(self.inner, flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: nn.Module) -> int:
    """Run every matmul of the model in TILE_ROWS-row calls; returns how many matmuls were
    wrapped."""
    wrapped = 0
    for module in list(model.modules()):
        if hasattr(module, "tile_rows"):  # a mixture of experts' ExpertMatrices
            module.tile_rows = TILE_ROWS
            wrapped += 1
        for name, child in list(module.named_children()):
            matmul = type(child) in DENSE_LINEAR_TYPES
            if not (isinstance(child, GGUFLinear | GGUFSplitLinear) or matmul):
                continue
            if not matmul:  # the float kernel's fp32 sums, not bf16 GEMMs of 8-row tiles
                child.bf16_gemm_rows = 0
            setattr(module, name, Tiled(child))
            wrapped += 1
    return wrapped
