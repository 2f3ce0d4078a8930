"""Which kernels take a hybrid model's state layers' decode rows: the GPU's
(cuda_state_ops, csrc/state_layers.cu), the CPU's (cpu_state_ops, csrc/cpu/state_layers.cpp),
or none (the layers' torch steps). Both modules take the same calls:
causal_conv_decode_, gated_delta_decode_, mamba2_decode_."""

from __future__ import annotations

from types import ModuleType

import torch

from zllm.executor.kernels import cpu_state_ops, cuda_state_ops


def decode_ops(x: torch.Tensor) -> ModuleType | None:
    if cuda_state_ops.usable(x):
        return cuda_state_ops
    if cpu_state_ops.usable(x):
        return cpu_state_ops
    return None
