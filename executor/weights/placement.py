"""Moving a model's tensors between devices in place: after load the blocks of a quantized
checkpoint onto the GPU (model.to() moves parameters and buffers only), and sleep level 1 on a
GPU sends the weights (and a vision model's encoder) to pinned host memory and back."""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear, GGUFSplitLinear


def _placed(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """`tensor` on `device`; `pin`: a copy in page-locked host memory, which copies back to
    a GPU at full bandwidth (one copy, straight into it)."""
    if pin:
        host = torch.empty_like(tensor, device=device, pin_memory=True)
        return host.copy_(tensor)
    return tensor.to(device)


def move_weights(model: nn.Module, device: torch.device, pin: bool = False) -> None:
    """Move every parameter and buffer to `device` in place (the Parameter objects stay, so
    modules that share one, e.g. tied embeddings, still share it: parameters() yields a
    shared one once), and the block modules' tensors (move_blocks_)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = _placed(tensor.data, device, pin)
    move_blocks_(model, device, pin)


def move_blocks_(model: nn.Module, device: torch.device, pin: bool = False) -> None:
    """Every block module's tensors to `device` (neither parameters nor buffers), each once
    (a tied embedding and logits keep sharing); `pin` as move_weights."""
    moved: dict[int, torch.Tensor] = {}

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in moved:
            moved[id(tensor)] = _placed(tensor, device, pin)
        return moved[id(tensor)]

    for module in model.modules():
        if isinstance(module, (GGUFLinear, GGUFEmbedding)):
            module.qweight = move(module.qweight)
        elif isinstance(module, GGUFSplitLinear):
            module.parts = [(move(q), t) for q, t in module.parts]
        else:
            continue
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and not isinstance(bias, nn.Parameter):
            module.bias = move(bias)
