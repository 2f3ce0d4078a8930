"""The dense MLP of our decoders: down(act(gate) * up) with gate and up one fused GEMM
[gate | up], the activation by its Hugging Face name (layers/activations.py: SwiGLU for
Llama's family and DeepSeek-V2, GeGLU for Gemma 3). Under tensor parallelism gate_up is
column-parallel (this rank's slice of the intermediate features) and down row-parallel: its
partial sums are added across ranks (executor/parallel/).
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.layers.activations import ACTIVATIONS, gated
from zllm.executor.layers.linear.dense import empty_linear
from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.model.arch_config import ModelArchConfig


class GatedMLP(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        intermediate_size: int | None = None,
        activation: str = "silu",
    ) -> None:
        """`arch`: this rank's (its slice of the intermediate features). `intermediate_size`:
        other than arch's (a shared expert's); `activation`: one of layers/activations.py's."""
        super().__init__()
        self.tp = tp
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = inter
        self.activation = activation
        self.gate_up_proj = empty_linear(arch.hidden_size, 2 * inter, dtype)
        self.down_proj = empty_linear(inter, arch.hidden_size, dtype)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face's gate/up/down tensors (`prefix`: "model.layers.3.mlp.") -> what each
        fills of ours (gate and up: the two halves of the fused matrix)."""
        gate, up = self.gate_up_proj.weight.data.split(self.intermediate_size)
        return {
            f"{prefix}gate_proj.weight": gate,
            f"{prefix}up_proj.weight": up,
            f"{prefix}down_proj.weight": self.down_proj.weight.data,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = gated(self.gate_up_proj(x), self.activation)
        return self.tp.all_reduce(self.down_proj(fused))


class UngatedMLP(nn.Module):
    """down(act(up(x))) without a gate (Nemotron-H's MLPs, "relu2"); one rank."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        activation: str,
        intermediate_size: int | None = None,
    ) -> None:
        """`intermediate_size`: other than arch's (a shared expert's)."""
        super().__init__()
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = inter
        self.activation = ACTIVATIONS[activation]
        self.up_proj = empty_linear(arch.hidden_size, inter, dtype)
        self.down_proj = empty_linear(inter, arch.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.up_proj(x)))
