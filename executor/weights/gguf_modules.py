"""The matmuls and the embedding lookup that read weight blocks through the CPU kernel
(csrc/cpu/gguf_linear.h, gguf_int8.h): a GGUF file's quantized blocks, or F16/BF16 rows
(16-bit files and checkpoints). executor/weights/blocks.py decides which matrices become
these; executor/weights/quantization.py, when.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.weights.gguf_arithmetic import integer_rows


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W held as GGUF blocks only (qweight [N, bytes per row])."""

    def __init__(
        self,
        qweight: torch.Tensor,
        ggml_type: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        arithmetic: str = "gguf-float",
    ) -> None:
        super().__init__()
        self.qweight = qweight
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.bias = bias
        # Integer dots for calls of at most this many rows (executor/weights/gguf_arithmetic.py)
        self.int8_max_rows = integer_rows(arithmetic, [ggml_type])

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        if self.int8_activations and flat.shape[0] <= self.int8_max_rows:
            y = cpu_kernels.gguf_linear_int8(flat, self.qweight, self.ggml_type)
        else:
            y = cpu_kernels.gguf_linear(flat, self.qweight, self.ggml_type)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        n = self.qweight.shape[0]
        return f"in_features={self.in_features}, out_features={n}, ggml_type={self.ggml_type}"


class GGUFSplitLinear(nn.Module):
    """A fused matmul whose parts are stored in different GGUF types: y = x [W_1; W_2; ...]^T
    with one kernel call per part, each writing its own columns of y (no concatenation)."""

    def __init__(
        self,
        parts: list[tuple[torch.Tensor, int]],
        in_features: int,
        bias: torch.Tensor | None = None,
        arithmetic: str = "gguf-float",
    ) -> None:
        super().__init__()
        self.parts = parts  # (qweight [rows, bytes per row], ggml type), in output order
        self.in_features = in_features
        self.out_features = sum(qweight.shape[0] for qweight, _ in parts)
        self.bias = bias
        self.int8_max_rows = integer_rows(arithmetic, [ggml_type for _, ggml_type in parts])

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        y = flat.new_empty(flat.shape[0], self.out_features)
        int8 = self.int8_activations and flat.shape[0] <= self.int8_max_rows
        start = 0
        for qweight, ggml_type in self.parts:
            rows = qweight.shape[0]
            columns = y[:, start : start + rows]
            if int8:
                cpu_kernels.gguf_linear_int8(flat, qweight, ggml_type, columns)
            else:
                cpu_kernels.gguf_linear_into(flat, qweight, ggml_type, columns)
            start += rows
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        types = ", ".join(cpu_kernels.KERNEL_TYPES[t] for _, t in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, types=[{types}]"


class GGUFEmbedding(nn.Module):
    """An embedding table held as GGUF blocks: the rows looked up are dequantized (bit for bit
    the fp32 table's rows). Tied to the logits, it shares its blocks with their GGUFLinear."""

    def __init__(self, qweight: torch.Tensor, ggml_type: int, embedding_dim: int) -> None:
        super().__init__()
        self.qweight = qweight
        self.ggml_type = ggml_type
        self.embedding_dim = embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, input_ids.reshape(-1))
        out = cpu_kernels.gguf_dequantize(rows, self.ggml_type, self.embedding_dim)
        return out.view(*input_ids.shape, self.embedding_dim)
