"""Act-order (GPTQ's desc_act, compressed-tensors' actorder "group"): the checkpoint's groups
follow a permutation of the input columns, so the blocks hold the columns in that order
(each group contiguous, to_blocks.input_order) and the matmul reads x in the same order:
y = x[:, order] W[:, order]^T, the same sum as x W^T.
"""

from __future__ import annotations

import torch
from torch import nn


class ActOrderLinear(nn.Module):
    """A block matmul whose columns are stored in `order`: gathers x's columns first."""

    def __init__(self, inner: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("order", order.long(), persistent=False)

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order))


class ActOrderParts(nn.Module):
    """A fused matmul (q/k/v, gate/up) whose parts were quantized in different column orders
    (a checkpoint whose tool ordered each matrix alone): each part gathers x in its own order
    and writes its own columns of y."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
