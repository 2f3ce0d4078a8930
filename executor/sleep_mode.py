"""Sleep mode's level 1 on a GPU: the weights wait in pinned host memory while the device's
memory is free, and come back without reading the model file (vLLM's "offload").

On CPU the weights already live in host memory, so level 1 leaves them where they are and
only the KV pool is released; moving them would free nothing.
"""

from __future__ import annotations

import torch
from torch import nn


def move_weights(model: nn.Module, device: torch.device, pin: bool = False) -> None:
    """Move every parameter and buffer to `device` in place (the Parameter objects stay, so
    modules that share one, e.g. tied embeddings, still share it: parameters() yields a
    shared one once); `pin`: into page-locked host memory, which copies back to a GPU at
    full bandwidth (one copy, straight into it)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if pin:
            host = torch.empty_like(tensor.data, device=device, pin_memory=True)
            tensor.data = host.copy_(tensor.data)
        else:
            tensor.data = tensor.data.to(device)
