"""Sleep mode's level 1 on a GPU: the weights wait in pinned host memory while the device's
memory is free, and come back without reading the model file (vLLM's "offload").

On CPU the weights already live in host memory, so level 1 leaves them where they are and
only the KV pool is released; moving them would free nothing.
"""

from __future__ import annotations

import torch
from torch import nn


def module_tensors(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer slot of the model, as (owner, name, tensor)."""
    slots = []
    for owner in model.modules():
        for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
            if tensor is not None:
                slots.append((owner, name, tensor))
    return slots


def move_weights(model: nn.Module, device: torch.device, pin: bool = False) -> None:
    """Move every parameter and buffer to `device` in place (the Parameter objects stay, so
    modules that share one, e.g. tied embeddings, still share it); `pin`: page-locked host
    memory, which copies back to a GPU at full bandwidth."""
    moved: dict[int, torch.Tensor] = {}
    for _, _, tensor in module_tensors(model):
        if id(tensor) in moved:
            continue
        data = tensor.data.to(device)
        if pin:
            data = data.pin_memory()
        tensor.data = data
        moved[id(tensor)] = data
