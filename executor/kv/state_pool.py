"""A hybrid model's recurrent-state slots, as tensors (zllm/kv/state_layout.py says what a
slot is; core/kv/state_slots.py which sequence holds which).

    StatePool(state, layers, num_slots, num_snapshots, device)
        layers[i]        LayerState of model layer i: conv [slots, conv_dim, kernel - 1] and
                         recurrent [slots, heads, key_head_dim, value_head_dim], fp32, zeroed;
                         the prefix cache's snapshots alike (snap_conv, snap_recurrent)
        copy(src, dst)   one slot's state into another (a beam's fork)
        stash(req, s)    keep a copy of slot s for req's forks (an n > 1 request's prompt
                         state: the parent may run a step further before its samples fork)
        fork(req, dst)   the stash (or, without one, nothing) into slot dst
        restore_snapshot(snapshot, slot)   a cached prefix's state into a sequence's slot
        release()        the tensors go (sleep mode); restore() brings back zeroed ones

The model's state layers read and write their LayerState in place, selecting the step's
sequences by slot (executor/kv/state_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zllm.kv.state_layout import STATE_ELEMENT_BYTES, layer_state_bytes
from zllm.model.arch_config import StateConfig

assert STATE_ELEMENT_BYTES == torch.empty((), dtype=torch.float32).element_size()


@dataclass(slots=True)
class LayerState:
    """One state layer's slots."""

    conv: torch.Tensor  # fp32 [slots, conv_dim, conv_kernel - 1]: the last inputs, oldest first
    recurrent: torch.Tensor  # fp32 [slots, heads, key_head_dim, value_head_dim]
    # The prefix cache's snapshots, [snapshots, ...] of the same rows (core/kv/state_slots.py
    # StateSnapshots names them); empty without prefix caching.
    snap_conv: torch.Tensor
    snap_recurrent: torch.Tensor


class StatePool:
    """Every state layer's slots of this rank (a pipeline stage's layers)."""

    def __init__(
        self,
        state: StateConfig,
        layers: list[int],
        num_slots: int,
        num_snapshots: int,
        device: torch.device,
    ) -> None:
        self.state = state
        self.layer_ids = list(layers)
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.device = device
        self.layers: dict[int, LayerState] = {}
        # req_id -> its prompt's state in every layer (conv, recurrent), until its forks.
        self._stashed: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.restore()

    @property
    def total_bytes(self) -> int:
        """Every slot's and snapshot's bytes."""
        return (self.num_slots + self.num_snapshots) * self.bytes_per_slot

    @property
    def bytes_per_slot(self) -> int:
        return len(self.layer_ids) * layer_state_bytes(self.state)

    def restore(self) -> None:
        s = self.state
        conv = (s.conv_dim, s.conv_kernel - 1)
        recurrent = (s.num_heads, s.key_head_dim, s.value_head_dim)

        def zeros(count: int, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros((count, *shape), dtype=torch.float32, device=self.device)

        self.layers = {
            layer: LayerState(
                conv=zeros(self.num_slots, conv),
                recurrent=zeros(self.num_slots, recurrent),
                snap_conv=zeros(self.num_snapshots, conv),
                snap_recurrent=zeros(self.num_snapshots, recurrent),
            )
            for layer in self.layer_ids
        }

    def release(self) -> None:
        self.layers = {}
        self._stashed = {}

    def copy(self, src: int, dst: int) -> None:
        for layer in self.layers.values():
            layer.conv[dst].copy_(layer.conv[src])
            layer.recurrent[dst].copy_(layer.recurrent[src])

    def restore_snapshot(self, snapshot: int, slot: int) -> None:
        for layer in self.layers.values():
            layer.conv[slot].copy_(layer.snap_conv[snapshot])
            layer.recurrent[slot].copy_(layer.snap_recurrent[snapshot])

    def stash(self, req_id: str, slot: int) -> None:
        self._stashed[req_id] = [
            (layer.conv[slot].clone(), layer.recurrent[slot].clone())
            for layer in self.layers.values()
        ]

    def fork(self, parent_id: str, parent_slot: int, dst: int) -> None:
        """A child's state as of its fork: the parent's stashed prompt state (an n > 1
        sample), else the parent's slot as it is (a beam: its parent is not ahead of it)."""
        stashed = self._stashed.get(parent_id)
        if stashed is None:
            if parent_slot >= 0:
                self.copy(parent_slot, dst)
            return
        for layer, (conv, recurrent) in zip(self.layers.values(), stashed, strict=True):
            layer.conv[dst].copy_(conv)
            layer.recurrent[dst].copy_(recurrent)

    def drop_stash(self, req_id: str) -> None:
        self._stashed.pop(req_id, None)

    @property
    def num_stashed(self) -> int:
        return len(self._stashed)
