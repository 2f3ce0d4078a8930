"""LoRALinear: a model matmul plus the low-rank updates of the adapters in the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zllm.executor.kernels.batch_invariant import tiled
from zllm.executor.lora.slots import LoRASlots
from zllm.executor.lora.weights import AdapterWeights


@dataclass(slots=True)
class LoRABatch:
    """This step's rows by adapter, shared by every LoRALinear of the model: for each
    adapter in the batch, its weights and its rows (the model runner orders the batch by
    adapter, so they are one slice)."""

    groups: list[tuple[AdapterWeights, slice]] = field(default_factory=list)
    # --deterministic: the updates in calls of exactly TILE_ROWS rows, so a row's bits do
    # not depend on how many rows share its adapter (batch_invariant.py).
    tiled: bool = False
    # Set where CUDA graphs replay LoRA steps: every update goes through the fixed slot
    # buffers (slots.py) and `groups` stays empty.
    slots: LoRASlots | None = None


class LoRALinear(nn.Module):
    """y = base(x), then y[rows] += (x[rows] @ A) @ B for each adapter's rows.

    One small matmul pair per adapter in the step, over just its rows (a segmented matmul):
    the base matmul runs once for the whole batch whatever the adapters, and the rows of the
    base model pay nothing. Where CUDA graphs replay the steps, the same update comes from
    fixed slot buffers instead (slots.py).
    """

    def __init__(self, base: nn.Module, batch: LoRABatch, layer: int, name: str) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.key = (layer, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.batch.slots is not None:  # always, even with no adapter: a graph's kernels
            out += self.batch.slots.update(self.key, x)
            return out
        if not self.batch.groups:
            return out
        # Rows are tokens: transformers' modules (the transformers backend) see [1, T, ...].
        x, y = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for weights, rows in self.batch.groups:
            update = weights.get(self.key)
            if update is None:
                continue
            if self.batch.tiled:
                y[rows] += tiled(lambda t, u=update: (t @ u.a_t) @ u.b_t, x[rows])
            else:
                y[rows].addmm_(x[rows] @ update.a_t, update.b_t)
        return out

    def extra_repr(self) -> str:
        return f"layer={self.key[0]}, matmul={self.key[1]}"
