"""LoRA in fixed slots: the same kernels for every step, whatever its adapters, so CUDA
graphs can replay them.

The segmented update (layers.py) runs one matmul pair per adapter in the step over its
rows: the number of calls and their shapes change with the batch, which a captured graph
cannot follow. Here each fused matmul keeps `num_slots` adapters side by side in two device
buffers of fixed shape,

    a_all [in, S * W]    (slot s's A in columns s*W .. s*W + r)
    b_all [S * W, out]   (slot s's B in the same rows; zeros past its rank)

where W is the widest rank an adapter can have there (max_lora_rank times the PEFT modules
the matmul fuses). A step's update is `((x @ a_all) * keep) @ b_all`, `keep` masking each row
to its own slot's columns (a row without an adapter keeps none: its update is exactly
zero). The rows' slots live in one static device tensor (`row_slot`), written before each
step, so a replay reads the step's adapters from memory, not from the captured shapes.
Two matmuls of width S * W per fused matmul cost more arithmetic than the segmented pair for
few adapters, but they are low-rank: a small share of the base matmul.

An adapter takes a free slot, or the least recently used one no row of the step needs;
its weights are copied in on the stream, after any queued step that still reads the slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from zllm.executor.host_to_device import to_device
from zllm.executor.lora.weights import AdapterWeights

MatmulKey = tuple[int, str]  # (layer, fused matmul name), as AdapterWeights


class LoRASlots:
    """The slot buffers of every wrapped matmul, the adapters in them, and the step's rows."""

    def __init__(
        self,
        shapes: dict[MatmulKey, tuple[int, int, int]],
        num_slots: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`shapes`: per wrapped matmul, (in_features, out_features, widest rank W)."""
        self.num_slots = num_slots
        self.device = device
        self.a_all: dict[MatmulKey, torch.Tensor] = {}
        self.b_all: dict[MatmulKey, torch.Tensor] = {}
        self.width: dict[MatmulKey, int] = {}
        # Per width W: each buffer column's slot (column j holds slot j // W).
        self._column_slot: dict[int, torch.Tensor] = {}
        for key, (in_features, out_features, width) in shapes.items():
            self.a_all[key] = torch.zeros(
                in_features, num_slots * width, dtype=dtype, device=device
            )
            self.b_all[key] = torch.zeros(
                num_slots * width, out_features, dtype=dtype, device=device
            )
            self.width[key] = width
            if width not in self._column_slot:
                columns = torch.arange(num_slots * width, device=device) // width
                self._column_slot[width] = columns.to(torch.int32)
        # Each token row's slot, -1 for none (and for a graph's padding rows). Graphs read
        # this one tensor; an eager step with more rows reads a larger one of its own.
        self.row_slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._rows = self.row_slot
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.a_all.values(), *self.b_all.values())
        )

    def place(self, lora_id: int, weights: AdapterWeights, keep: set[int]) -> int:
        """The adapter's slot, its weights copied in if it was not resident; `keep`: the
        adapters the step also needs, whose slots are not taken."""
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self._slot_of if i not in keep), None)
            if victim is None:  # the scheduler keeps a step within max_loras adapters
                raise RuntimeError(f"a step needs more than {self.num_slots} LoRA slots")
            slot = self._slot_of.pop(victim)
        self._write(slot, weights)
        self._slot_of[lora_id] = slot
        return slot

    def forget(self, lora_id: int) -> None:
        """An unloaded adapter: its slot becomes free (its stale weights are overwritten
        before any row reads them)."""
        self._slot_of.pop(lora_id, None)

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        for key, a_all in self.a_all.items():
            width, b_all = self.width[key], self.b_all[key]
            columns = slice(slot * width, (slot + 1) * width)
            a_all[:, columns].zero_()
            b_all[columns].zero_()
            update = weights.get(key)
            if update is not None:
                rank = update.a_t.shape[1]
                a_all[:, slot * width : slot * width + rank].copy_(update.a_t)
                b_all[slot * width : slot * width + rank].copy_(update.b_t)

    def set_rows(self, slots: np.ndarray) -> None:
        """This step's token rows' slots (-1: no adapter); the rows past them read -1."""
        n = len(slots)
        rows = to_device(slots.astype(np.int32), self.device)
        if n > self.row_slot.shape[0]:  # larger than any graph: an eager step
            self._rows = rows
            return
        self._rows = self.row_slot
        self.row_slot[:n].copy_(rows)
        self.row_slot[n:].fill_(-1)

    def update(self, key: MatmulKey, x: torch.Tensor) -> torch.Tensor:
        """[T, out]: each row's own adapter's (x A) B, zero for rows without one."""
        xa = x @ self.a_all[key]
        keep = self._column_slot[self.width[key]][None, :] == self._rows[: x.shape[0], None]
        return (xa * keep) @ self.b_all[key]


def rows_by_slot(slot_of_request: Sequence[int], query_lens: Sequence[int]) -> np.ndarray:
    """int32 [T]: each token row's slot, from each request's slot and row count."""
    return np.repeat(np.asarray(slot_of_request, dtype=np.int32), np.asarray(query_lens))
