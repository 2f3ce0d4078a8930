"""Quantized weights for CPU serving.

GGUF files (`gguf`, the default for one on CPU; `gguf-float`; `gguf-int8`): the decoder's
matmuls, the logits and the embedding lookup read the file's own blocks (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, NVFP4: csrc/cpu/gguf_lattice.h; F16, BF16) instead of
fp32 copies, and the fp32 tensors they replace are released after load: the weights take
about the file's size in memory (only F32 matrices stay fp32). Which arithmetic multiplies
them, per type, CPU and call size, is executor/weights/gguf_arithmetic.py's rule:
- the float kernel (csrc/cpu/gguf_linear.h; every type; all of `gguf-float`): the values
  multiplied are bit for bit the fp32 weights the reference path uses (the kernel
  dequantizes as gguf.quants does; tests check it), so only the order of the sums differs.
  Decode-sized calls turn each block's codes into floats in registers and apply the block's
  scale to its dot product; prefill chunks dequantize a few weight rows into a small fp32
  panel and multiply there (outer-product register tiles), with no copy of the matrix;
- integer dots (csrc/cpu/gguf_int8.h, kquant_int8.h; `gguf` where measured faster, all of
  `gguf-int8`): x rounded to int8 per 32 values (per 256 for the K-quants, whose whole
  super-blocks are summed in integers), llama.cpp's arithmetic: accuracy in BENCHMARKS.md.
A fused matmul whose parts the file stores in different types (Gemma 3's q/k in Q5_0 beside v
in Q8_0) runs one kernel call per part, each writing its columns of the output.

Quantized checkpoints (`compressed-tensors`, `gptq`, `awq`, `fp8`: the checkpoint's own
method, zllm/config/quantization.py): their packed codes are laid out once at load as the
same kernels' Q4_0/Q4_1/Q8_0 blocks, or 16-bit rows (executor/weights/quantized/), and from
there served as a GGUF file's blocks are (blocks.py: every block source, a GGUF file, a
16-bit checkpoint or a quantized one, names the tensors it serves before the load and gives
each matmul its module).

`int8` (opt-in): int8 weights, one scale per output channel, with activations quantized per
call (dynamic quantization) in fbgemm. Far from fp32 on SmolLM2 (BENCHMARKS.md); kept for
models without activation outliers.

`none`: fp32 everywhere, the reference.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zllm.config.quantization import CHECKPOINT_QUANTIZATIONS
from zllm.executor.weights.blocks import gguf_kernel_plan, gguf_matmuls, use_gguf_blocks_
from zllm.executor.weights.gguf_arithmetic import GGUF_METHODS, INTEGER_TYPES
from zllm.model.gguf import read_gguf

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = (*GGUF_METHODS, "int8", *CHECKPOINT_QUANTIZATIONS, "none")


def quantize_model_(
    model: nn.Module, method: str, model_path: str | None = None, strict: bool = True
) -> None:
    """Swap the model's matmuls for quantized ones, in place.

    `strict` (the method was asked for): refuse a GGUF file whose decoder matmuls the kernel
    cannot all serve. Not strict (the engine's own choice): serve what it can.
    """
    check_quantization(method, model_path, strict)
    if method in GGUF_METHODS:
        use_gguf_blocks_(model, model_path, method)
    elif method == "int8":
        _int8_model_(model)


def check_quantization(method: str, model_path: str | None, strict: bool = True) -> None:
    """Refuse (ValueError) a method that is unknown or cannot serve this model."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if method in GGUF_METHODS:
        reason = "no model file" if model_path is None else gguf_kernel_plan(model_path, strict)
        if reason is not None:
            raise ValueError(f"--quantization {method} cannot serve this model: {reason}")
    if method == "gguf-int8":
        decoder, head = gguf_matmuls(read_gguf(model_path))
        types = {t for m in [*decoder, head] if m is not None for t in m.types}
        if not {int(t) for t in types} & INTEGER_TYPES:
            names = ", ".join(sorted(t.name for t in types))
            raise ValueError(
                f"--quantization gguf-int8 has no integer path for this file's matrices "
                f"({names}); use gguf or gguf-float"
            )


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
