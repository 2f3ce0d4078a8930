"""Tensor-parallel matmul modules: a row-parallel nn.Linear (this rank's input columns, the
partial products summed across ranks) and the record of which part of the whole matrix a
cut module holds. Column-parallel cuts need no module of their own: a rank's nn.Linear holds
its output rows (executor/parallel/ says how each tensor is cut).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from zllm.executor.parallel.groups import TensorParallel


class RankPart(NamedTuple):
    """Which part of the whole matrix a cut nn.Linear holds, kept on it as `rank_part` so a
    later swap (executor/models/transformers/quant.py) cuts the checkpoint's blocks the same
    way: its output rows (colwise) or its input columns (rowwise, the `local` matmul of a
    RowParallelLinear)."""

    rows: slice | None = None
    columns: slice | None = None


class RowParallelLinear(nn.Module):
    """A row-parallel matmul: this rank's input columns of the weight (`local`, no bias),
    the partial products summed across the ranks, then the whole bias added once. LoRA wraps
    `local`, so an adapter's partial update joins the sum before the all-reduce."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel, columns: slice) -> None:
        """`columns`: this rank's input columns of `linear` (its even share)."""
        super().__init__()
        self.local = nn.Linear(
            columns.stop - columns.start,
            linear.out_features,
            bias=False,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        self.local.weight.data = linear.weight.data[:, columns].contiguous()
        self.local.rank_part = RankPart(columns=columns)
        self.bias = linear.bias  # whole: added once, after the sum
        self.tp = tp
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"rank {self.tp.rank} of {self.tp.size}, whole in_features={self.in_features}"
