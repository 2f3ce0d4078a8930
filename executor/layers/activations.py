"""Activations by their Hugging Face names, and the gated form most MLPs of ours take:
act(gate) * up over a fused [gate | up] projection (SwiGLU for "silu", GeGLU for the GELUs);
Nemotron-H's MLPs apply "relu2" (relu(x)^2) to an ungated up projection.

`gated` runs a device's fused op where one serves the rows (csrc/cpu/row_ops.h on CPU, the
fused decode step's own; csrc/layer_ops.cu's SiLU-and-mul on a GPU, torch's bits), else
torch's ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zllm.executor.kernels import cpu_layer_ops, cuda_layer_ops

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu2": lambda x: F.relu(x).square(),
}


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up [rows, gate | up] -> [rows, width / 2]; `activation` one of
    ACTIVATIONS."""
    fused = None
    if activation == "silu" and cuda_layer_ops.usable(gate_up):
        fused = cuda_layer_ops.silu_mul(gate_up)
    elif cpu_layer_ops.usable(gate_up):
        fused = cpu_layer_ops.gated_act(gate_up, activation)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up
