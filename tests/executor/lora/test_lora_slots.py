"""LoRA in fixed slot buffers (executor/lora/slots.py), the form CUDA graphs can replay: the
update each row gets equals its own adapter's (x A) B, a row without one gets exact zeros,
slots are reused least recently used first, never under a row of the step, and the rows'
slots are read from one static tensor (so a replay sees the step's adapters)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zllm.executor.lora.slots import LoRASlots, rows_by_slot
from zllm.executor.lora.weights import FusedLoRA

IN, OUT, WIDTH = 24, 40, 8  # WIDTH: the widest rank a slot holds
KEY = (0, "qkv_proj")


def adapter(rank: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a_t = torch.randn(IN, rank, generator=gen, dtype=torch.float64)
    b_t = torch.randn(rank, OUT, generator=gen, dtype=torch.float64)
    return {KEY: FusedLoRA(a_t, b_t)}


def make_slots(num_slots: int = 2, max_tokens: int = 16) -> LoRASlots:
    return LoRASlots(
        {KEY: (IN, OUT, WIDTH)}, num_slots, max_tokens, torch.float64, torch.device("cpu")
    )


def expected(x: torch.Tensor, row_adapters: list[dict | None]) -> torch.Tensor:
    rows = [
        torch.zeros(OUT, dtype=torch.float64) if w is None else (x[i] @ w[KEY].a_t) @ w[KEY].b_t
        for i, w in enumerate(row_adapters)
    ]
    return torch.stack(rows)


def test_each_row_gets_its_own_adapter_and_base_rows_get_zeros():
    slots = make_slots()
    one, two = adapter(rank=3, seed=1), adapter(rank=WIDTH, seed=2)
    step = {1, 2}
    slot_of = [-1, slots.place(1, one, step), slots.place(2, two, step)]
    slots.set_rows(rows_by_slot(slot_of, [2, 3, 1]))  # 2 base rows, 3 of adapter 1, 1 of 2
    x = torch.randn(6, IN, dtype=torch.float64)
    update = slots.update(KEY, x)
    torch.testing.assert_close(update, expected(x, [None, None, one, one, one, two]))
    assert update[:2].abs().max() == 0  # exactly: nothing added to the base model's rows


def test_a_slot_is_reused_least_recently_used_first_and_never_under_the_step():
    slots = make_slots(num_slots=2)
    weights = {i: adapter(rank=2 + i, seed=i) for i in (1, 2, 3)}
    assert slots.place(1, weights[1], {1}) == 0
    assert slots.place(2, weights[2], {2}) == 1
    assert slots.place(1, weights[1], {1}) == 0  # resident: used again, now most recent
    assert slots.place(3, weights[3], {3}) == 1  # adapter 2 was least recently used
    # A step that needs 1 and 3 keeps both; a third adapter in it has nowhere to go.
    with pytest.raises(RuntimeError, match="more than 2 LoRA slots"):
        slots.place(2, weights[2], {1, 2, 3})
    # The reused slot holds adapter 3 only: a smaller rank than before leaves no stale columns.
    slots.set_rows(rows_by_slot([1], [1]))
    x = torch.randn(1, IN, dtype=torch.float64)
    torch.testing.assert_close(slots.update(KEY, x), expected(x, [weights[3]]))


def test_a_forgotten_adapter_frees_its_slot():
    slots = make_slots(num_slots=1)
    slots.place(1, adapter(2, 1), {1})
    slots.forget(1)
    assert slots.place(2, adapter(2, 2), {2}) == 0


def test_rows_are_read_from_one_static_tensor_padding_reads_minus_one():
    slots = make_slots(max_tokens=8)
    static = slots.row_slot
    slots.place(1, adapter(2, 1), {1})
    slots.set_rows(rows_by_slot([0, -1], [3, 2]))
    assert slots.row_slot is static
    assert static.tolist() == [0, 0, 0, -1, -1, -1, -1, -1]
    # A step of more rows than the static tensor holds runs eagerly on its own tensor; the
    # static one (what graphs read) is left as it was.
    slots.set_rows(np.zeros(12, dtype=np.int32))
    x = torch.randn(12, IN, dtype=torch.float64)
    assert slots.update(KEY, x).abs().min() > 0
    assert slots.row_slot is static


def test_a_matmul_the_adapter_leaves_alone_adds_nothing():
    other = (0, "o_proj")
    slots = LoRASlots({KEY: (IN, OUT, WIDTH), other: (IN, OUT, WIDTH)}, 1, 4, torch.float64,
                      torch.device("cpu"))  # fmt: skip
    slots.place(1, adapter(2, 1), {1})  # qkv_proj only
    slots.set_rows(rows_by_slot([0], [2]))
    assert slots.update(other, torch.randn(2, IN, dtype=torch.float64)).abs().max() == 0
