"""executor/host_to_device.py: rows taken on the device as a slice when they are consecutive,
else through an uploaded index; both give tensor[rows]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zllm.executor.host_to_device import consecutive, take_rows


@pytest.mark.parametrize(
    ("rows", "expected"),
    [([], False), ([3], True), ([3, 4], True), ([3, 5], False), ([1, 2, 3], True),
     ([1, 2, 4], False), ([1, 3, 2], False), ([0, 2, 1, 3], False), ([5, 4], False)],
)  # fmt: skip
def test_consecutive_rows(rows, expected) -> None:
    assert consecutive(rows) is expected
    assert consecutive(np.asarray(rows, dtype=np.int64)) is expected


@pytest.mark.parametrize("rows", [[2, 3, 4], [4], [0, 2, 1, 3], [3, 1]])
def test_take_rows_is_indexing(rows) -> None:
    tensor = torch.arange(30.0).view(6, 5)
    for given in (rows, np.asarray(rows, dtype=np.int64)):
        taken = take_rows(tensor, given)
        assert torch.equal(taken, tensor[torch.tensor(rows)])
        # A slice is a view of the same storage; an indexed gather is a copy.
        assert (taken.data_ptr() == tensor[rows[0]].data_ptr()) == consecutive(rows)
