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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from zllm.config import ModelArchConfig
from zllm.executor import cpu_kernels
from zllm.model_files import GGUFFile, read_gguf

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


def quantize_model_(
    model: nn.Module, method: str, model_path: str | None = None, strict: bool = True
) -> None:
    """Swap the model's matmuls for quantized ones, in place.

    `strict` (the method was asked for): refuse a GGUF file whose decoder matmuls the kernel
    cannot all serve. Not strict (the engine's own choice): serve what it can.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if method == "gguf":
        reason = "no model file" if model_path is None else gguf_kernel_plan(model_path, strict)
        if reason is not None:
            raise ValueError(f"--quantization gguf cannot serve this model: {reason}")
        use_gguf_blocks_(model, model_path)
    elif method == "int8":
        _int8_model_(model)


def gguf_kernel_plan(model_path: str, strict: bool = False) -> str | None:
    """Why the GGUF kernel cannot serve this file, or None when it can. Reads only the header.

    A file may mix types (llama.cpp's presets do: Q4_K_M holds Q4_K, Q6_K and sometimes Q5_0
    or Q8_0). Not strict, the engine's default: the kernel serves the file if it can serve any
    matmul; the others keep fp32 matmuls on the weights every path loads (use_gguf_blocks_
    logs which). Strict, --quantization gguf asked for: every decoder matmul must be served,
    else the reason names the first tensor that is not. The logits may stay fp32 either way:
    llama.cpp writes output.weight as Q6_K in most presets, which would refuse most files.
    """
    if not model_path.endswith(".gguf"):
        return "the model is not a GGUF file"
    decoder, head = gguf_matmuls(read_gguf(model_path))
    reasons = [m.unservable() for m in decoder]
    if strict:
        first = next((r for r in reasons if r is not None), None)
        if first is not None:
            return (
                f"{first}; leave --quantization unset to use the kernel where the file allows "
                f"and fp32 matmuls elsewhere"
            )
        return None
    if any(r is None for r in reasons) or (head is not None and head.unservable() is None):
        return None
    types = sorted({t.name for m in [*decoder, head] if m is not None for t in m.types})
    return f"no matmul of the file is Q4_1 or Q8_0 (its matrices are {', '.join(types)})"


@dataclass(frozen=True, slots=True)
class GGUFMatmul:
    """The GGUF tensors one kernel matmul would read: a fused one reads its parts' rows
    concatenated, so they must share one type."""

    tensors: tuple[str, ...]
    types: tuple[GGMLQuantizationType, ...]

    def unservable(self) -> str | None:
        """Why the kernel cannot read these blocks (naming tensor and type), or None."""
        for name, ggml_type in zip(self.tensors, self.types, strict=True):
            if int(ggml_type) not in cpu_kernels.SUPPORTED_GGML_TYPES:
                return f"tensor {name!r} is {ggml_type.name} (the kernel reads Q4_1 and Q8_0)"
        if len(set(self.types)) > 1:
            named = zip(self.tensors, self.types, strict=True)
            parts = ", ".join(f"{name} {ggml_type.name}" for name, ggml_type in named)
            return f"one fused matmul reads tensors of different types ({parts})"
        return None


# Per layer, the GGUF tensors (blk.{i}.<key>.weight) behind each matmul the kernel replaces:
# the model's fused qkv and gate/up projections, then the output and down projections.
_LAYER_MATMULS = (
    ("attn_q", "attn_k", "attn_v"),
    ("attn_output",),
    ("ffn_gate", "ffn_up"),
    ("ffn_down",),
)


def gguf_matmuls(gguf: GGUFFile) -> tuple[list[GGUFMatmul], GGUFMatmul | None]:
    """The decoder's matmuls layer by layer, and the logits' (output.weight, else the tied
    embedding), from the file's tensor names and types."""

    def matmul(names: list[str]) -> GGUFMatmul | None:
        infos = [gguf.tensors.get(n) for n in names]
        if any(info is None for info in infos):
            return None
        return GGUFMatmul(tuple(names), tuple(info.ggml_type for info in infos))

    numbers = {name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}
    layers = sorted((n for n in numbers if n.isdigit()), key=int)
    decoder = [
        matmul([f"blk.{layer}.{key}.weight" for key in keys])
        for layer in layers
        for keys in _LAYER_MATMULS
    ]
    head = matmul(["output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"])
    return [m for m in decoder if m is not None], head


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
        "GGUF kernels: %d of %d decoder matmuls and %s read GGUF blocks%s",
        swapped,
        swapped + kept,
        "the logits" if head is not None else "not the logits",
        _fp32_note(model_path) if kept else "",
    )


def _fp32_note(model_path: str) -> str:
    """For the log: why the matmuls the kernel does not serve stay fp32."""
    decoder, _ = gguf_matmuls(read_gguf(model_path))
    reasons = [r for r in (m.unservable() for m in decoder) if r is not None]
    if not reasons:
        return ""
    return f"; {len(reasons)} multiply fp32 weights dequantized at load (first: {reasons[0]})"


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
