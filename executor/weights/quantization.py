"""Quantized weights for CPU serving.

`gguf` (the default for a GGUF file on CPU, `--quantization gguf`): the decoder's matmuls, the
logits and the embedding lookup read the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, TQ1_0, TQ2_0, NVFP4: csrc/cpu/gguf_lattice.h; F16, BF16) through csrc/cpu/gguf_linear.h
instead of fp32 copies, and the fp32 tensors they replace are released after load: the weights
take about the file's size in memory (only F32 matrices stay fp32). The values multiplied are
bit for bit the fp32 weights the reference path uses (the kernel dequantizes as gguf.quants
does; tests check it), so only the order of the arithmetic differs; a decode step reads 4-7x
fewer bytes (up to 20x for IQ1). Decode-sized calls (1-4 rows; 1-2 for Q5_0, Q5_1, Q6_K,
Q2_K, Q3_K) go through the kernel's few-rows path, which turns each block's codes into floats
in registers and applies the block's scale (and offset) to its dot product rather than to each value. Many rows
(prefill chunks) go through the kernel's panel path, which dequantizes a few weight rows into
a small fp32 panel and multiplies them there (outer-product register tiles from 16 rows), with
no copy of the matrix (BENCHMARKS.md compares it with the BLAS GEMM on an fp32 copy). A fused matmul whose parts
the file stores in different types (Gemma 3's q/k in Q5_0 beside v in Q8_0) runs one kernel
call per part, each writing its columns of the output.

`gguf-int8` (opt-in): the same blocks, llama.cpp-style arithmetic for decode-sized calls: x is
rounded to int8 per 32 values (per 256 for Q4_K and Q6_K, whose whole super-blocks are then
summed in integers: csrc/cpu/kquant_int8.h) and multiplied by the codes with integer dot
products (csrc/cpu/gguf_int8.h), 1.2-2.5x faster per matmul at one row than the float kernel. Calls of
more than INT8_MAX_ROWS rows (prefill chunks, large decode batches) keep the float kernel,
where the integer path is slower (Q2_K, Q3_K, Q4_K and Q6_K take csrc/cpu/kquant_int8.h at
every row count). It changes the arithmetic: accuracy in BENCHMARKS.md. IQ4_NL, IQ4_XS, MXFP4,
the IQ1-IQ3, TQ and NVFP4 types and 16-bit weights have no integer path: their matmuls keep
the float kernel (the load's log says which).

`int8` (opt-in): int8 weights, one scale per output channel, with activations quantized per
call (dynamic quantization) in fbgemm. Far from fp32 on SmolLM2 (BENCHMARKS.md); kept for
models without activation outliers.

`none`: fp32 everywhere, the reference.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zllm.executor.weights.blocks import gguf_kernel_plan, use_gguf_blocks_

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "gguf-int8", "int8", "none")


def quantize_model_(
    model: nn.Module, method: str, model_path: str | None = None, strict: bool = True
) -> None:
    """Swap the model's matmuls for quantized ones, in place.

    `strict` (the method was asked for): refuse a GGUF file whose decoder matmuls the kernel
    cannot all serve. Not strict (the engine's own choice): serve what it can.
    """
    check_quantization(method, model_path, strict)
    if method in ("gguf", "gguf-int8"):
        use_gguf_blocks_(model, model_path, int8_activations=method == "gguf-int8")
    elif method == "int8":
        _int8_model_(model)


def check_quantization(method: str, model_path: str | None, strict: bool = True) -> None:
    """Refuse (ValueError) a method that is unknown or cannot serve this model."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if method in ("gguf", "gguf-int8"):
        reason = "no model file" if model_path is None else gguf_kernel_plan(model_path, strict)
        if reason is not None:
            raise ValueError(f"--quantization {method} cannot serve this model: {reason}")


# The engine's own choice for a bf16/fp16 checkpoint on CPU (not a --quantization choice): its
# matrices stay 16-bit in memory and the kernel widens them to fp32 in registers, so a decode
# step reads half the bytes of an fp32 copy, with the same values (both widen exactly).
SIXTEEN_BIT = "16-bit"


def sixteen_bit_checkpoint(model_path: str) -> bool:
    """Whether a Hugging Face directory stores its decoder's matrices in bf16 or fp16 (read
    from the safetensors headers, nothing loaded)."""
    from zllm.executor.weights.loader import safetensors_dtypes

    if model_path.endswith(".gguf"):
        return False
    dtypes = safetensors_dtypes(model_path)
    matrices = [d for name, d in dtypes.items() if name.endswith("_proj.weight")]
    return bool(matrices) and all(d in ("BF16", "F16") for d in matrices)


def set_int8_max_rows(model: nn.Module, rows: int) -> int:
    """Make gguf-int8 matmuls take the integer path up to `rows` rows; returns how many
    modules it set. `zllm bench accuracy` scores a whole sequence in one prefill with the
    arithmetic decode gives each row (x is rounded per row, so a row's result does not depend
    on the others)."""
    modules = [m for m in model.modules() if getattr(m, "int8_activations", False)]
    for module in modules:
        module.int8_max_rows = rows
    return len(modules)


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
        if hasattr(mlp, "gate_up_proj"):  # (a mixture-of-experts MLP keeps its experts fp32)
            mlp.gate_up_proj = _int8(mlp.gate_up_proj)


def _int8(linear: nn.Linear) -> Int8DynamicLinear:
    return Int8DynamicLinear(linear.weight, linear.bias)
