"""The experts of a mixture-of-experts layer: one projection of every expert
(`ExpertMatrices`: a stacked float tensor, or a GGUF file's blocks that the CPU kernel
multiplies in place, csrc/cpu/gguf_linear.cpp), and the rule's activation over an expert's
[gate | up] rows.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels.batch_invariant import TILE_ROWS, tiled
from zllm.executor.kernels.gguf_arithmetic import integer_rows
from zllm.executor.layers.activations import gated
from zllm.executor.layers.moe.router import CLAMPED_SWIGLU, RELU2, SILU, MoERule


def gated_activation(gate_up: torch.Tensor, rule: MoERule) -> torch.Tensor:
    """act(gate) * up of an expert's gate_up rows [n, 2 x intermediate] -> [n, intermediate]
    (relu2: act(up) of its up rows [n, intermediate], no gate)."""
    if rule.activation == RELU2:
        return F.relu(gate_up).square()
    if rule.activation == SILU and not rule.interleaved_gate_up:
        return gated(gate_up, SILU)  # the dense MLPs' SwiGLU, fused where a kernel serves it
    if rule.interleaved_gate_up:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if rule.activation == SILU:
        return F.silu(gate) * up
    if rule.activation != CLAMPED_SWIGLU:
        raise ValueError(f"unknown expert activation {rule.activation!r}")
    gate = gate.clamp(max=rule.swiglu_limit)
    up = up.clamp(min=-rule.swiglu_limit, max=rule.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * rule.swiglu_alpha))


# Linux's MAP_NORESERVE (0x4000 on x86-64 and arm64; Python's mmap module does not name it).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
# Float placeholders from this size up are mapped without reserving memory.
_UNRESERVED_BYTES = 1 << 30


def untouched_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, whose pages cost nothing until written, also
    where the tensor is larger than the machine's memory. A GGUF file's experts replace their
    float placeholder with blocks before it is ever written, but DeepSeek-V3's [256, 4096,
    7168] fp32 gate_up alone is 30 GB: Linux's default overcommit check refuses one mapping
    that large on a machine with less, before the blocks can replace it. Large placeholders
    are therefore anonymous mappings without a reservation (pages still come zeroed on first
    touch; a checkpoint that does fill them needs the memory, as with torch.empty)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _UNRESERVED_BYTES or sys.platform != "linux":
        return torch.empty(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    pages = mmap.mmap(-1, nbytes, flags=flags)
    # (the tensor holds the mapping: it is unmapped when the placeholder is dropped)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class ExpertMatrices(nn.Module):
    """One projection of every expert: y = x W_e^T (+ b_e) for the rows routed to expert e.

    `weight` [E, out, in] in the model's dtype, until hold_blocks_ swaps in blocks
    [E, rows, bytes per row] per part (a fused projection whose parts a file stores in
    different types has several, each writing its own columns of y)."""

    def __init__(
        self,
        num_experts: int,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.out_features = out_features
        self.in_features = in_features
        # Plain empty tensors (untouched pages): load_weights fills them, or blocks replace them.
        shape = (num_experts, out_features, in_features)
        self.weight: nn.Parameter | None = nn.Parameter(untouched_empty(shape, dtype))
        self.bias = (
            nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype)) if bias else None
        )
        self.parts: list[tuple[torch.Tensor, int]] | None = None  # (blocks, ggml type)
        self.int8_max_rows = 0  # integer dots up to this many rows (gguf_arithmetic.py)
        # --deterministic (make_batch_invariant): every call in TILE_ROWS-row tiles, so an
        # expert's rows do not depend on how many other tokens chose it this step.
        self.tile_rows: int | None = None

    def hold_blocks_(
        self, parts: list[tuple[torch.Tensor, int]], arithmetic: str = "gguf-float"
    ) -> None:
        """Multiply these blocks ([E, rows, bytes per row] each, rows summing to
        out_features) from now on; the float weight is dropped."""
        rows = sum(blocks.shape[1] for blocks, _ in parts)
        if rows != self.out_features or any(b.shape[0] != self.num_experts for b, _ in parts):
            shapes = [tuple(b.shape) for b, _ in parts]
            raise ValueError(f"expert blocks {shapes} for {self.num_experts} x {self.out_features}")
        self.parts = [(blocks.contiguous(), ggml_type) for blocks, ggml_type in parts]
        types = [ggml_type for _, ggml_type in parts]
        self.int8_max_rows = integer_rows(arithmetic, types)
        self.weight = None

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def held_bytes(self) -> int:
        """Bytes of the expert matrices held (blocks, or the float weight)."""
        if self.parts is not None:
            return sum(blocks.numel() * blocks.element_size() for blocks, _ in self.parts)
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [n, in] (rows contiguous) -> [n, out] through expert `expert`'s matrix."""
        if self.tile_rows is not None:
            assert self.tile_rows == TILE_ROWS
            return tiled(lambda rows: self._multiply(rows, expert), x)
        return self._multiply(x, expert)

    def _multiply(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[expert]
        if self.parts is None:
            assert self.weight is not None
            return F.linear(x, self.weight[expert], bias)
        y = x.new_empty(x.shape[0], self.out_features)
        int8 = self.int8_activations and x.shape[0] <= self.int8_max_rows
        start = 0
        for blocks, ggml_type in self.parts:
            rows = blocks.shape[1]
            columns = y if len(self.parts) == 1 else y[:, start : start + rows]
            if int8:
                cpu_kernels.gguf_linear_int8(x, blocks[expert], ggml_type, columns)
            else:
                cpu_kernels.gguf_linear_into(x, blocks[expert], ggml_type, columns)
            start += rows
        if bias is not None:
            y.add_(bias)
        return y

    def serves_grouped(self, x: torch.Tensor) -> bool:
        """Whether grouped() takes rows like x: blocks, no --deterministic tiles, fp32 rows
        on the CPU."""
        return self.parts is not None and self.tile_rows is None and _kernel_rows(x)

    def grouped(self, x: torch.Tensor, groups: tuple[list[int], list[int]]) -> torch.Tensor:
        """x [R, in] through the chosen experts in one kernel call per part (one parallel
        region, csrc/cpu/moe_experts.cpp), groups = (experts, row starts); the bits the
        per-expert calls give. Only where serves_grouped(x)."""
        assert self.parts is not None
        y = x.new_empty(x.shape[0], self.out_features)
        int8_rows = self.int8_max_rows
        start = 0
        for blocks, ggml_type in self.parts:
            rows = blocks.shape[1]
            columns = y if len(self.parts) == 1 else y[:, start : start + rows]
            cpu_kernels.moe_experts_linear(x, blocks, ggml_type, groups, int8_rows, columns)
            start += rows
        if self.bias is not None:
            experts, starts = groups
            for g, expert in enumerate(experts):
                y[starts[g] : starts[g + 1]].add_(self.bias[expert])
        return y

    def extra_repr(self) -> str:
        held = "float"
        if self.parts is not None:
            names = cpu_kernels.SUPPORTED_GGML_TYPES
            held = "types=" + "/".join(names.get(t, str(t)) for _, t in self.parts)
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, {held}"


def _kernel_rows(x: torch.Tensor) -> bool:
    """x is rows the CPU kernel reads in place: fp32 on the CPU, rows contiguous."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
