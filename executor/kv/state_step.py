"""What a hybrid model's state layers read of a step (executor/kv/state_pool.py holds the
slots): each sequence's rows of the flat batch, its slot, and whether it starts afresh.

    sequences     | a (prompt, fresh) | b | c | d (chunk 2) |
    query_start   0                   5   6   7             12
    slots         [ 3                 , 0 , 7 , 1          ]
    fresh         [ True              , F , F , False      ]   a starts from zeros
    decode        b, c: one new token each, stepped together as one batch

A sequence is fresh when its first new token is position 0: a new prompt, or one recomputed
after a preemption, whatever the slot held before (so slots are never cleared); one admitted
on a prefix hit starts from the snapshot copied into its slot before the step. A save
(the prefix cache's) splits a sequence's rows at its position: the state there goes to the
snapshot. The layers' arithmetic is executor/layers/gated_delta_net.py's and mamba2.py's;
the helpers below are what both do with a step's sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zllm.executor.host_to_device import to_device
from zllm.executor.kv.state_pool import LayerState


@dataclass(slots=True)
class StateStep:
    """The state layers' metadata of one step (one for every state layer)."""

    query_start: list[int]  # [S + 1]: sequence i's rows are [query_start[i], query_start[i+1])
    slots: list[int]  # [S]
    fresh_slots: torch.Tensor  # int64 [F]: slots whose sequence starts at position 0
    decode_seqs: list[int]  # sequences with exactly one new token (stepped as a batch)
    decode_rows: torch.Tensor  # int64 [D]: their rows of the flat batch
    decode_slots: torch.Tensor  # int64 [D]: their slots
    prefill_seqs: list[int]  # sequences with more than one new token (chunked)
    # The prefix cache's saves: sequence -> (its new rows before the save, snapshot): the
    # state after that many of its new tokens goes to the snapshot.
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        slots: list[int],
        device: torch.device | str,
        saves: dict[int, tuple[int, int]] | None = None,
    ) -> StateStep:
        if any(slot < 0 for slot in slots):
            raise ValueError(f"a sequence of a hybrid model without a state slot: {slots}")
        q = np.asarray(query_lens, dtype=np.int64)
        start = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=start[1:])
        first_position = np.asarray(seq_lens, dtype=np.int64) - q
        slot_array = np.asarray(slots, dtype=np.int64)
        decode = np.flatnonzero(q == 1)
        return cls(
            query_start=start.tolist(),
            slots=list(slots),
            fresh_slots=to_device(slot_array[first_position == 0], device, torch.int64),
            decode_seqs=decode.tolist(),
            decode_rows=to_device(start[decode], device, torch.int64),
            decode_slots=to_device(slot_array[decode], device, torch.int64),
            prefill_seqs=np.flatnonzero(q > 1).tolist(),
            saves=saves or {},
        )


def saves_by_sequence(
    req_ids: Sequence[str],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    state_saves: Sequence[tuple[str, int, int]],
) -> dict[int, tuple[int, int]]:
    """SchedulerOutput.state_saves as StateStep.saves: each (req_id, position, snapshot) as
    its sequence's index -> (rows before the position, snapshot)."""
    if not state_saves:
        return {}
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    saves = {}
    for req_id, position, snapshot in state_saves:
        i = index.get(req_id)
        if i is None:
            continue  # (it failed to start: no state here)
        offset = position - (seq_lens[i] - query_lens[i])
        assert 0 < offset <= query_lens[i], (req_id, position, seq_lens[i], query_lens[i])
        saves[i] = (offset, snapshot)
    return saves


def start_fresh(cache: LayerState, step: StateStep) -> None:
    """Zero the slots of the sequences that start at position 0."""
    if step.fresh_slots.numel():
        cache.conv.index_fill_(0, step.fresh_slots, 0.0)
        cache.recurrent.index_fill_(0, step.fresh_slots, 0.0)


def pieces(start: int, end: int, save: tuple[int, int] | None) -> list[tuple[int, int, int | None]]:
    """A prompt chunk's rows [start, end) as (start, end, snapshot to save after them): cut
    where a save falls inside it (one at its end is copied from the slot afterwards)."""
    if save is None or start + save[0] >= end:
        return [(start, end, None)]
    cut = start + save[0]
    return [(start, cut, save[1]), (cut, end, None)]


def save_at_ends(cache: LayerState, step: StateStep) -> None:
    """Saves that fall on a sequence's last new row: its slot's state as the step left it."""
    bounds = step.query_start
    for i, (offset, snapshot) in step.saves.items():
        if bounds[i] + offset == bounds[i + 1]:
            cache.snap_conv[snapshot] = cache.conv[step.slots[i]]
            cache.snap_recurrent[snapshot] = cache.recurrent[step.slots[i]]
