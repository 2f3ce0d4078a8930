"""Quantized weights for CPU serving.

`gguf` (the default for a GGUF file on CPU, `--quantization gguf`): the decoder's matmuls read
the file's own Q4_1 / Q8_0 blocks through csrc/cpu/gguf_linear.h instead of fp32 copies. The
values multiplied are bit for bit the fp32 weights the reference path uses (the kernel
dequantizes as gguf.quants does; load checks it), so only summation order differs; a decode
step reads 4-6x fewer bytes. Large batches (prefill chunks) are compute-bound, where the BLAS
GEMM on the fp32 copy is faster, so each layer keeps both and picks per call by row count.

`int8` (opt-in): int8 weights, one scale per output channel, with activations quantized per
call (dynamic quantization) in fbgemm. Far from fp32 on SmolLM2 (BENCHMARKS.md); kept for
models without activation outliers.

`none`: fp32 everywhere, the reference.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from zllm.config import ModelArchConfig
from zllm.executor import cpu_kernels

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "int8", "none")

# Up to this many rows (tokens) per call the GGUF kernel beats the fp32 GEMM on a 2-core AVX2
# machine (BENCHMARKS.md, the matmuls of one step, kernel vs torch: 1.9x at 1 row, 1.8x at
# 32, 1.7x at 64, 1.1x at 128 and 256, even from 512 on).
GGUF_KERNEL_MAX_ROWS = 256


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W held twice: GGUF blocks for few rows, fp32 for many."""

    def __init__(
        self,
        qweight: torch.Tensor,
        ggml_type: int,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        max_kernel_rows: int = GGUF_KERNEL_MAX_ROWS,
    ) -> None:
        super().__init__()
        self.qweight = qweight
        self.ggml_type = ggml_type
        self.weight = weight
        self.bias = bias
        self.max_kernel_rows = max_kernel_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_kernel_rows or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        y = cpu_kernels.gguf_linear(
            x if x.stride(-1) == 1 else x.contiguous(), self.qweight, self.ggml_type
        )
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, ggml_type={self.ggml_type}"


def quantize_model_(model: nn.Module, method: str, model_path: str | None = None) -> None:
    """Swap the model's matmuls for quantized ones, in place."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if method == "gguf":
        reason = "no model file" if model_path is None else gguf_kernel_plan(model_path)
        if reason is not None:
            raise ValueError(f"--quantization gguf cannot serve this model: {reason}")
        use_gguf_blocks_(model, model_path)
    elif method == "int8":
        _int8_model_(model)


def gguf_kernel_plan(model_path: str) -> str | None:
    """Why the GGUF kernel cannot serve this file, or None when it can (any supported tensor)."""
    from zllm.model_files import read_gguf

    if not model_path.endswith(".gguf"):
        return "the model is not a GGUF file"
    gguf = read_gguf(model_path)
    if not any(int(t.ggml_type) in cpu_kernels.SUPPORTED_GGML_TYPES for t in gguf.tensors.values()):
        return "no tensor of the file is Q4_1 or Q8_0"
    return None


def use_gguf_blocks_(model: nn.Module, model_path: str) -> None:
    """Point every matmul whose GGUF tensors are all Q4_1 or Q8_0 at those blocks."""
    from zllm.executor.loader import gguf_raw_weights

    cpu_kernels.load()  # build (or load) the extension first: a build failure surfaces here, once
    arch: ModelArchConfig = model.arch
    raw = gguf_raw_weights(model_path, arch)

    def fuse(
        names: list[str], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> GGUFLinear | None:
        """One GGUFLinear over the row-concatenated blocks of names, if they all qualify."""
        parts = [raw.get(n) for n in names]
        if any(p is None for p in parts):
            return None
        types = {ggml_type for ggml_type, _ in parts}
        ggml_type = types.pop()
        if types or ggml_type not in cpu_kernels.SUPPORTED_GGML_TYPES:
            return None
        qweight = torch.cat([rows for _, rows in parts]).contiguous()
        # The kernel must multiply by exactly the weights the fp32 path holds.
        if not torch.equal(
            cpu_kernels.gguf_dequantize(qweight, ggml_type, weight.shape[1]), weight
        ):
            raise RuntimeError(f"GGUF blocks of {names} do not dequantize to the loaded weights")
        return GGUFLinear(qweight, ggml_type, weight, bias)

    swapped = kept = 0
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        targets = [
            (attn, "qkv_proj", [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]),
            (attn, "o_proj", [f"{p}self_attn.o_proj.weight"]),
            (mlp, "gate_up_proj", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
            (mlp, "down_proj", [f"{p}mlp.down_proj.weight"]),
        ]
        for module, attr, names in targets:
            linear = getattr(module, attr)
            new = fuse(names, linear.weight.data, None if linear.bias is None else linear.bias.data)
            if new is None:
                kept += 1
            else:
                setattr(module, attr, new)
                swapped += 1
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head_weight = model.embed_tokens if model.lm_head is None else model.lm_head
    head = fuse([head_name], head_weight.data, None)
    if head is not None:
        model.logits_proj = head
    logger.info(
        "GGUF kernels: %d of %d decoder matmuls and %s read GGUF blocks",
        swapped,
        swapped + kept,
        "the logits" if head is not None else "not the logits",
    )


class Int8DynamicLinear(nn.Module):
    """int8 x int8 -> int32 in fbgemm; `reduce_range` keeps activations to 7 bits, as fbgemm
    needs on CPUs without VNNI so the int16 pair sums of VPMADDUBSW cannot saturate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        out_features = w.shape[0]
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10).double()
        qweight = torch.quantize_per_channel(
            w, scales, torch.zeros(out_features, dtype=torch.long), 0, torch.qint8
        )
        b = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, b)
        self.in_features = w.shape[1]
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _int8_model_(model: nn.Module) -> None:
    """The decoder's qkv, output and gate/up matmuls in int8.

    The down projection and the logits stay fp32: measured on SmolLM2 (BENCHMARKS.md), their
    inputs carry the outliers that per-tensor activation scales cannot hold, and quantizing
    them triples the logprob drift.
    """
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _int8(attn.qkv_proj)
        attn.o_proj = _int8(attn.o_proj)
        mlp.gate_up_proj = _int8(mlp.gate_up_proj)


def _int8(linear: nn.Linear) -> Int8DynamicLinear:
    return Int8DynamicLinear(linear.weight, linear.bias)
