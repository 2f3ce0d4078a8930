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
