"""The matmuls and the embedding lookup that read weight blocks through the CPU kernel
(csrc/cpu/gguf_linear.cpp, gguf_int8.cpp): a GGUF file's quantized blocks, or F16/BF16 rows
(16-bit files and checkpoints). executor/weights/blocks.py decides which matrices become
these; executor/weights/quantization.py, when.

On a GPU (a quantized checkpoint's Q4_0/Q4_1/Q8_0/FP8_E4M3 blocks), gpu_layout_ makes each
16-bit matrix (the embedding, the logits, what a checkpoint leaves unquantized) a plain
weight of the model's dtype (type DENSE), placement.move_blocks_ puts the blocks on the device
after load, and the same modules multiply them through executor/kernels/cuda_blocks.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cuda_blocks
from zllm.executor.kernels.gguf_arithmetic import BF16, bf16_gemm_rows, integer_rows
from zllm.executor.layers.moe.experts import ExpertMatrices

# On a GPU: a matrix held as a plain [out, in] weight of the model's dtype (a 16-bit one).
DENSE = -1
_SIXTEEN_BIT = {1: torch.float16, 30: torch.bfloat16}  # ggml F16, BF16


def _dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for a DENSE weight, which may keep another 16-bit type than x (gpu_layout_)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)


def _bf16_gemm_into(
    x16: torch.Tensor, qweight: torch.Tensor, ggml_type: int, y: torch.Tensor
) -> None:
    """y[:] = x W^T as torch's bf16 GEMM (oneDNN: AMX tiles where the CPU has them), x16 being
    x rounded to bf16: fp32 sums, the output rounded to bf16 and widened (torch has no bf16 x
    bf16 -> fp32 GEMM on CPU). BF16 rows are the GEMM's operand as they are; quantized blocks
    are dequantized to bf16 a panel at a time (csrc/cpu/gguf_gemm.cpp).
    gguf_arithmetic.bf16_gemm_rows: when."""
    if ggml_type == BF16:
        y.copy_(F.linear(x16, qweight.view(torch.bfloat16)))
    else:
        cpu_kernels.gguf_linear_bf16_into(x16, qweight, ggml_type, y)


def _gpu_linear_into(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, out: torch.Tensor
) -> None:
    if ggml_type == DENSE:
        out.copy_(_dense_linear(x, qweight))
    else:
        cuda_blocks.linear_into(x, qweight, ggml_type, out)


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
        # Integer dots for calls of at most this many rows, bf16 GEMMs from this many (0:
        # never; executor/kernels/gguf_arithmetic.py)
        self.int8_max_rows = integer_rows(arithmetic, [ggml_type])
        self.bf16_gemm_rows = bf16_gemm_rows(arithmetic, [ggml_type])

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        if on_gpu(flat):
            if self.ggml_type == DENSE:
                y = _dense_linear(flat, self.qweight)
            else:
                y = flat.new_empty(flat.shape[0], self.out_features)
                cuda_blocks.linear_into(flat, self.qweight, self.ggml_type, y)
        elif 0 < self.bf16_gemm_rows <= flat.shape[0]:
            y = flat.new_empty(flat.shape[0], self.out_features)
            _bf16_gemm_into(flat.to(torch.bfloat16), self.qweight, self.ggml_type, y)
        elif self.int8_activations and flat.shape[0] <= self.int8_max_rows:
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
        types = [ggml_type for _, ggml_type in parts]
        self.int8_max_rows = integer_rows(arithmetic, types)
        self.bf16_gemm_rows = bf16_gemm_rows(arithmetic, types)

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        y = flat.new_empty(flat.shape[0], self.out_features)
        gpu = on_gpu(flat)
        # x rounded to bf16 once for every part, on the CPU only (a GPU host may have AMX too)
        bf16 = not gpu and 0 < self.bf16_gemm_rows <= flat.shape[0]
        x16 = flat.to(torch.bfloat16) if bf16 else None
        int8 = not bf16 and self.int8_activations and flat.shape[0] <= self.int8_max_rows
        start = 0
        for qweight, ggml_type in self.parts:
            rows = qweight.shape[0]
            columns = y[:, start : start + rows]
            if gpu:
                _gpu_linear_into(flat, qweight, ggml_type, columns)
            elif x16 is not None:
                _bf16_gemm_into(x16, qweight, ggml_type, columns)
            elif int8:
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
        if self.ggml_type == DENSE:
            return rows.view(*input_ids.shape, self.embedding_dim)
        out = cpu_kernels.gguf_dequantize(rows, self.ggml_type, self.embedding_dim)
        return out.view(*input_ids.shape, self.embedding_dim)


def on_gpu(x: torch.Tensor) -> bool:
    """Whether a call takes the GPU kernels (the CPU tests' emulator says yes for CPU tensors)."""
    return x.is_cuda


def gpu_layout_(model: nn.Module, dtype: torch.dtype) -> int:
    """The block modules as the GPU kernels read them, in place: 16-bit rows become DENSE
    weights of `dtype` (each once: a tied embedding and logits keep sharing). Refuses
    (ValueError) a type the GPU has no kernel for, and experts held in blocks. Returns how
    many modules hold blocks the GPU kernels read."""
    dense: dict[tuple[int, bool], torch.Tensor] = {}

    def laid_out(
        name: str, qweight: torch.Tensor, ggml_type: int, lookup: bool = False
    ) -> tuple[torch.Tensor, int]:
        if ggml_type in _SIXTEEN_BIT:
            stored = qweight.view(_SIXTEEN_BIT[ggml_type])
            # fp32 holds either exactly; bf16 and fp16 not each other (to_blocks picks BF16
            # where fp16 would overflow): a matmul's keeps its own type then. An embedding's
            # rows are looked up in the model's dtype.
            exact = dtype == torch.float32 or dtype == stored.dtype
            key = (id(qweight), exact or lookup)
            if key not in dense:
                dense[key] = stored.to(dtype) if exact or lookup else stored.clone()
            return dense[key], DENSE
        if ggml_type != DENSE and not cuda_blocks.supported(ggml_type):
            kind = cpu_kernels.KERNEL_TYPES.get(ggml_type, str(ggml_type))
            raise ValueError(
                f"{name}: {kind} blocks have no GPU kernel (the GPU reads Q4_0, Q4_1, Q8_0 "
                f"and FP8_E4M3 blocks: quantized checkpoints' layouts)"
            )
        return qweight, ggml_type

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, GGUFEmbedding) and module.ggml_type not in (*_SIXTEEN_BIT, DENSE):
            raise ValueError(
                f"{name}: an embedding held in quantized blocks has no GPU lookup (quantized "
                f"checkpoints keep theirs 16-bit); serve this model on CPU"
            )
        if isinstance(module, (GGUFLinear, GGUFEmbedding)):
            lookup = isinstance(module, GGUFEmbedding)
            module.qweight, module.ggml_type = laid_out(
                name, module.qweight, module.ggml_type, lookup
            )
        elif isinstance(module, GGUFSplitLinear):
            module.parts = [laid_out(name, q, t) for q, t in module.parts]
        elif isinstance(module, ExpertMatrices) and module.parts is not None:
            raise ValueError(
                f"{name}: experts held in blocks (a quantized mixture of experts) have no GPU "
                f"kernel yet; serve this checkpoint on CPU"
            )
        else:
            continue
        count += 1
    return count
