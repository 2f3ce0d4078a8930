"""Moving a model's tensors between devices in place: sleep level 1 on a GPU sends the
weights (and a vision model's encoder) to pinned host memory and brings them back."""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.weights.gguf_modules import move_blocks_


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
    move_blocks_(model, device, pin)  # a quantized checkpoint's blocks are neither
