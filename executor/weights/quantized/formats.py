"""Each quantized checkpoint format's tensors for one matmul, unpacked into plain codes,
scales and zero points (to_blocks.IntegerWeight) or fp8 values with their scales
(FloatWeight). The layouts, as their writers store them:

compressed-tensors (llm-compressor)
  pack-quantized   weight_packed int32 [out, in*bits/32]: codes + 2^(bits-1) packed
                   densely along a row, lowest bits first; weight_scale [out, groups];
                   weight_zero_point (with zero points) packed the same way along the
                   output dimension; weight_g_idx [in] (act-order "group")
  int-quantized    weight int8 [out, in] (signed codes), weight_scale [out, 1]
  float-quantized  weight float8_e4m3fn [out, in], weight_scale [out, 1], [1] or per block
GPTQ               qweight int32 [in*bits/32, out] packed along the input dimension,
                   qzeros int32 [groups, out*bits/32] along the output dimension (the "gptq"
                   v1 packing stores zero - 1), scales fp16 [groups, out], g_idx int32 [in]
AWQ (GEMM)         qweight int32 [in, out/8] along the output dimension in the interleaved
                   order 0 2 4 6 1 3 5 7, qzeros int32 [groups, out/8] alike, scales
                   [groups, out]
fp8                weight float8_e4m3fn [out, in], weight_scale_inv [out/128, in/128] (per
                   block) or weight_scale (per tensor)

The dequantized weight is scale * (code - zero) everywhere (fp8: value * scale).
"""

from __future__ import annotations

import sys

import torch

from zllm.config.quantization import WeightFormat
from zllm.executor.weights.quantized.to_blocks import FloatWeight, IntegerWeight

if sys.byteorder != "little":  # the unpacking below reads int32 words as their bytes
    raise ImportError("quantized checkpoints are read on little-endian hosts only")

# AWQ packs eight columns per word in this order; _AWQ_NATURAL undoes it.
_AWQ_NATURAL = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])

Tensors = dict[str, torch.Tensor]  # one module's checkpoint tensors by suffix (qweight, ...)


class MissingTensor(ValueError):
    """A tensor the format needs is not in the checkpoint, or has the wrong shape."""


def read_matmul(
    method: str, packing: str, fmt: WeightFormat, module: str, tensors: Tensors
) -> IntegerWeight | FloatWeight:
    """The weight of `module` from its tensors (names in errors are the checkpoint's), its
    tensors' shapes checked against each other: a malformed checkpoint is refused naming
    them, never read into wrong values or a torch error."""
    try:
        weight = _read(method, packing, fmt, module, tensors)
    except RuntimeError as exc:  # a torch reshape or broadcast over tensors that do not fit
        raise MissingTensor(f"{module}: {_shapes(tensors)} do not fit together ({exc})") from None
    problem = _misfit(weight)
    if problem is not None:
        raise MissingTensor(f"{module}: {problem} ({_shapes(tensors)})")
    return weight


def _read(method: str, packing: str, fmt: WeightFormat, module: str, tensors: Tensors):
    def need(suffix: str) -> torch.Tensor:
        if suffix not in tensors:
            raise MissingTensor(f"{module}.{suffix} is missing ({method} {packing} needs it)")
        return tensors[suffix]

    if method == "gptq":
        return _gptq(need, fmt, v1=packing == "gptq")
    if method == "awq":
        return _awq(need, fmt)
    if method == "fp8":
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        if scale is None:
            raise MissingTensor(f"{module}.weight_scale_inv is missing (fp8 needs it)")
        return FloatWeight(need("weight"), scale.float().reshape(*_scale_shape(scale)), fmt.block)
    return _compressed_tensors(need, tensors, fmt, module)


def unpack_rows(words: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """int32 [rows, words] packed densely along each row, lowest bits first (4 or 8 bits per
    value) -> uint8 [rows, columns]."""
    data = words.contiguous().view(torch.uint8)
    if bits == 8:
        return data[:, :columns]
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(data.shape[0], -1)[:, :columns]


def _gptq(need, fmt: WeightFormat, v1: bool) -> IntegerWeight:
    qweight, scales = need("qweight"), need("scales")
    in_features = qweight.shape[0] * 32 // fmt.bits
    out_features = qweight.shape[1]
    codes = unpack_rows(qweight.t(), fmt.bits, in_features)
    zeros = unpack_rows(need("qzeros"), fmt.bits, out_features).t().to(torch.int32)
    if v1:  # GPTQ's first packing stores each zero point minus one (wrapping: 0 as all ones)
        zeros = (zeros + 1) & ((1 << fmt.bits) - 1)
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    g_idx = need("g_idx") if fmt.act_order else None
    return IntegerWeight(codes, scales.t().float(), zeros, fmt.bits, group_size, g_idx)


def _awq(need, fmt: WeightFormat) -> IntegerWeight:
    qweight, scales = need("qweight"), need("scales")
    in_features = qweight.shape[0]

    def natural(words: torch.Tensor) -> torch.Tensor:
        rows = unpack_rows(words, 4, words.shape[1] * 8).view(words.shape[0], -1, 8)
        return rows[..., _AWQ_NATURAL].reshape(words.shape[0], -1)

    codes = natural(qweight).t().contiguous()
    zeros = natural(need("qzeros")).t().to(torch.int32)
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    return IntegerWeight(codes, scales.t().float(), zeros, 4, group_size)


def _compressed_tensors(need, tensors: Tensors, fmt: WeightFormat, module: str):
    scale = need("weight_scale").float()
    if fmt.kind == "float":
        return FloatWeight(need("weight"), scale.reshape(*_scale_shape(scale)), fmt.block)
    middle = 1 << (fmt.bits - 1)
    if "weight_packed" in tensors:
        shape = tensors.get("weight_shape")
        packed = need("weight_packed")
        columns = int(shape[1]) if shape is not None else packed.shape[1] * 32 // fmt.bits
        if shape is not None and (
            int(shape[0]) != packed.shape[0] or packed.shape[1] * 32 < columns * fmt.bits
        ):
            raise MissingTensor(
                f"{module}.weight_packed {list(packed.shape)} does not hold weight_shape "
                f"{[int(x) for x in shape]} at {fmt.bits} bits"
            )
        codes = unpack_rows(packed, fmt.bits, columns)
    else:  # int-quantized / naive: signed codes stored as int8
        codes = (need("weight").to(torch.int16) + middle).to(torch.uint8)
    out_features, in_features = codes.shape
    scale = scale.reshape(out_features, -1) if scale.numel() > 1 else scale.expand(out_features, 1)
    groups = scale.shape[1]
    if fmt.symmetric:
        zeros = torch.full((out_features, groups), middle, dtype=torch.int32)
    else:
        stored = need("weight_zero_point")
        if stored.dtype == torch.int32:  # packed along the output dimension
            zeros = unpack_rows(stored.t(), fmt.bits, out_features).t().to(torch.int32)
        else:  # signed zero points as stored
            zeros = stored.to(torch.int32).reshape(out_features, -1) + middle
    if zeros.shape != (out_features, groups):
        raise MissingTensor(f"{module}.weight_zero_point has shape {tuple(zeros.shape)}")
    group_size = in_features // groups
    g_idx = tensors.get("weight_g_idx") if fmt.act_order else None
    return IntegerWeight(codes, scale.contiguous(), zeros, fmt.bits, group_size, g_idx)


def _misfit(weight: IntegerWeight | FloatWeight) -> str | None:
    """Why the unpacked tensors cannot be one matrix's weight, or None."""
    if isinstance(weight, FloatWeight):
        out_features, in_features = weight.values.shape
        scale = tuple(weight.scale.shape)
        if weight.block is None:
            fits = scale in ((1, 1), (out_features, 1))
            wanted = f"[1] or [{out_features}, 1]"
        else:
            rows, columns = weight.block
            blocks = (-(-out_features // rows), -(-in_features // columns))
            fits, wanted = scale == blocks, f"{list(blocks)} (blocks of {rows}x{columns})"
        return None if fits else f"the scale has shape {list(scale)} where {wanted} fits"
    out_features, in_features = weight.codes.shape
    groups = weight.scales.shape[1]
    if weight.scales.shape[0] != out_features:
        return f"the scales cover {weight.scales.shape[0]} rows of {out_features}"
    if tuple(weight.zeros.shape) != tuple(weight.scales.shape):
        return f"zero points {list(weight.zeros.shape)} beside scales {list(weight.scales.shape)}"
    if weight.g_idx is not None:
        g_idx = weight.g_idx
        if tuple(g_idx.shape) != (in_features,):
            return f"g_idx has shape {list(g_idx.shape)} for {in_features} columns"
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            return f"g_idx names groups outside 0..{groups - 1}"
    elif (
        groups * weight.group_size < in_features or (groups - 1) * weight.group_size >= in_features
    ):
        return f"{groups} groups of {weight.group_size} do not cover {in_features} columns"
    return None


def _shapes(tensors: Tensors) -> str:
    """Each tensor's suffix and shape, for an error: "qweight [16, 256], scales [1, 256]"."""
    return ", ".join(f"{suffix} {list(t.shape)}" for suffix, t in sorted(tensors.items()))


def _scale_shape(scale: torch.Tensor) -> tuple[int, ...]:
    """A per-tensor scale as [1, 1]; per-channel [out] as [out, 1]; 2-D as stored."""
    if scale.numel() == 1:
        return (1, 1)
    return tuple(scale.shape) if scale.dim() == 2 else (scale.shape[0], 1)
