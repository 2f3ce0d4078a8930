"""Host values to a device tensor without waiting for the device.

A plain copy to a GPU (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`) waits for
every kernel queued before it to finish. With the asynchronous executor the next step's
inputs are built while the last step still runs (async_steps.py), so each such copy would
undo the overlap: every step input goes through `to_device`, which queues the copy
(`non_blocking`; the driver stages pageable memory at once, so the host buffer may go).
On CPU it is the host tensor itself (a numpy array's memory, not copied).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: np.ndarray | Sequence, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`values` (an array, or a list of numbers or of equal-length lists) on `device`."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
        if dtype is not None:
            host = host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True)


def consecutive(indices: np.ndarray | Sequence[int]) -> bool:
    """Whether `indices` are i, i + 1, ..., i + n - 1 (n >= 1): rows a slice can take on
    the device, with no index to upload (a copy and a gather kernel saved per use)."""
    n = len(indices)
    if n == 0 or indices[-1] - indices[0] != n - 1:
        return False
    if n < 3:
        return True
    if isinstance(indices, np.ndarray):
        return bool((np.diff(indices) == 1).all())
    return all(indices[i + 1] - indices[i] == 1 for i in range(n - 1))


def take_rows(tensor: torch.Tensor, rows: np.ndarray | Sequence[int]) -> torch.Tensor:
    """tensor[rows] along dim 0, `rows` on the host: a view when they are consecutive."""
    if consecutive(rows):
        return tensor[rows[0] : rows[0] + len(rows)]
    return tensor[to_device(rows, tensor.device, torch.int64)]
