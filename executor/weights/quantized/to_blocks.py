"""Group-quantized integer weights (and fp8 ones) as blocks the CPU kernels read.

A group of columns with one scale and one zero point is a GGUF block repeated: the kernels'
blocks hold 32 columns each, so a group of 128 becomes four blocks with the same scale. What
each stored kind becomes:

  int4, symmetric (zero at 8)      Q4_0: d * (q - 8), d the group's scale     exact
  int4 with zero points            Q4_1: d * q + m, m = -scale * zero          m rounded to fp16
  int8, symmetric (zero at 128)    Q8_0: d * (q - 128)                        exact
  fp8 (e4m3), its scale per tensor, FP8_E4M3 (zllm's own): Q8_0's layout,   exact (scales
  channel or 32-multiple block     e4m3 values for codes, the scale as d      fp16 holds)
  int8 with zero points; fp8       F16 rows of the dequantized values         rounded to fp16
  whose scales fp16 cannot hold    (BF16 where a value overflows fp16)

"Exact": the values multiplied are the checkpoint's dequantized weights computed in fp32,
scales that fp16 holds exactly (bf16 and fp16 scales in fp16's normal range). Blocks take
4.5 bits per weight for int4 (Q4_0; 5 for Q4_1) and 8.5 for int8 and fp8: a few percent above
the checkpoint's packing, never an fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zllm.executor.kernels.cpu import FP8_E4M3

Q4_0, Q4_1, Q8_0, F16, BF16 = 2, 3, 8, 1, 30
BLOCK = 32  # columns per GGUF block of these types

Blocks = tuple[int, torch.Tensor]  # (ggml type id, rows as uint8 [out, bytes per row])


@dataclass
class IntegerWeight:
    """A matrix's integer codes with their groups' scales and zero points, all in natural
    column order unless `g_idx` says otherwise (act-order)."""

    codes: torch.Tensor  # uint8 [out, in], unsigned: 0 .. 2^bits - 1
    scales: torch.Tensor  # fp32 [out, groups]
    zeros: torch.Tensor  # int32 [out, groups], in the codes' unsigned range
    bits: int
    group_size: int  # columns per group
    g_idx: torch.Tensor | None = None  # int [in]: each column's group (act-order)


@dataclass
class FloatWeight:
    """fp8 values and the scale each multiplies by (broadcast to [out, in] in row chunks)."""

    values: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # fp32: [out, 1], [1, 1] or per block [out/rows, in/cols]
    block: tuple[int, int] | None = None


class UnservableWeight(ValueError):
    """The stored weight cannot be laid out for the kernels (the message says why)."""


def input_order(weight: IntegerWeight) -> torch.Tensor | None:
    """Act-order: the column order in which each group's columns are contiguous (x is read
    in this order by the matmul), or None when the groups already follow the columns."""
    if weight.g_idx is None:
        return None
    g_idx = weight.g_idx.long()
    natural = torch.arange(g_idx.numel()) // weight.group_size
    if torch.equal(g_idx, natural):
        return None
    counts = torch.bincount(g_idx)
    if not bool((counts == weight.group_size).all()):
        raise UnservableWeight(f"g_idx groups are not all {weight.group_size} columns")
    return torch.argsort(g_idx, stable=True)


def integer_blocks(weight: IntegerWeight, order: torch.Tensor | None) -> Blocks:
    """The weight as Q4_0 / Q4_1 / Q8_0 blocks (F16 rows for int8 with zero points), its
    columns taken in `order` (input_order's) when given."""
    codes, scales, zeros = weight.codes, weight.scales, weight.zeros
    out_features, in_features = codes.shape
    if order is not None:
        codes = codes[:, order]
        group_of = weight.g_idx.long()[order]  # now runs of group_size equal groups
        scales = scales[:, group_of[:: weight.group_size]]
        zeros = zeros[:, group_of[:: weight.group_size]]
    if in_features % BLOCK or weight.group_size % BLOCK:
        raise UnservableWeight(
            f"{in_features} columns in groups of {weight.group_size}: the kernels' blocks "
            f"hold {BLOCK} columns"
        )
    if in_features % weight.group_size:
        raise UnservableWeight(
            f"{in_features} columns in groups of {weight.group_size}: the last group is partial"
        )
    per_block = weight.group_size // BLOCK
    scales = scales.repeat_interleave(per_block, dim=1)  # [out, blocks]
    zeros = zeros.repeat_interleave(per_block, dim=1)
    blocks = codes.view(out_features, in_features // BLOCK, BLOCK)
    middle = 1 << (weight.bits - 1)
    symmetric = bool((zeros == middle).all())
    d = _fp16(scales)
    if weight.bits == 4:
        qs = blocks[..., :16] | (blocks[..., 16:] << 4)
        if symmetric:
            parts = [d, qs]
            ggml_type = Q4_0
        else:
            parts = [d, _fp16(-scales * zeros.float()), qs]
            ggml_type = Q4_1
    elif symmetric:
        qs = (blocks.to(torch.int16) - middle).to(torch.int8).view(torch.uint8)
        parts = [d, qs]
        ggml_type = Q8_0
    else:
        values = (codes.float() - zeros.repeat_interleave(BLOCK, dim=1).float()) * (
            scales.repeat_interleave(BLOCK, dim=1)
        )
        return sixteen_bit_rows(values)
    rows = torch.cat(parts, dim=-1).reshape(out_features, -1)
    return ggml_type, rows.contiguous()


def float_blocks(weight: FloatWeight) -> Blocks:
    """fp8 values as FP8_E4M3 blocks (the kernel widens them in registers), the scale of each
    32 columns as the block's fp16 d; F16 rows where a block would straddle two scales or a
    scale is beyond fp16's normal range."""
    values = weight.values
    out_features, in_features = values.shape
    block_columns = BLOCK if weight.block is None else weight.block[1]
    if in_features % BLOCK or block_columns % BLOCK:
        return float_rows(weight)
    scale = weight.scale
    if weight.block is not None:
        scale = scale.repeat_interleave(weight.block[0], dim=0)[:out_features]
        scale = scale.repeat_interleave(block_columns // BLOCK, dim=1)
    blocks = in_features // BLOCK
    # One scale per 32 columns: a tensor's or a channel's broadcast, a block's cut to the row.
    scale = scale.expand(out_features, blocks) if scale.shape[1] == 1 else scale[:, :blocks]
    if not bool(((scale.abs() >= 2**-14) & (scale.abs() <= 65504)).all()):
        return float_rows(weight)
    d = scale.half().view(torch.uint8).view(out_features, -1, 2)
    codes = values.view(torch.uint8).view(out_features, -1, BLOCK)
    return FP8_E4M3, torch.cat([d, codes], dim=-1).reshape(out_features, -1).contiguous()


def float_rows(weight: FloatWeight) -> Blocks:
    """fp8 values times their scales, as F16 rows (BF16 where fp16 would overflow), widened
    a chunk of rows at a time (never the whole matrix in fp32)."""
    values = weight.values
    out_features, in_features = values.shape
    rows_per_chunk = max(1, (1 << 20) // in_features)
    for dtype, ggml_type in ((torch.float16, F16), (torch.bfloat16, BF16)):
        rows = torch.empty(out_features, in_features, dtype=dtype)
        for start in range(0, out_features, rows_per_chunk):
            stop = min(start + rows_per_chunk, out_features)
            scale = _scale_rows(weight, start, stop, in_features)
            part = (values[start:stop].float() * scale).to(dtype)
            if not bool(torch.isfinite(part).all()):
                break  # beyond fp16's range: BF16 rows
            rows[start:stop] = part
        else:
            return ggml_type, rows.view(torch.uint8)
    raise UnservableWeight("fp8 values times their scales are not finite")


def sixteen_bit_rows(values: torch.Tensor) -> Blocks:
    """fp32 values as F16 rows, or BF16 where fp16 would overflow."""
    half = values.half()
    if bool(torch.isfinite(half).all()):
        return F16, half.view(torch.uint8)
    return BF16, values.bfloat16().view(torch.uint8)


def _scale_rows(weight: FloatWeight, start: int, stop: int, in_features: int) -> torch.Tensor:
    scale = weight.scale
    if weight.block is None:
        return scale[start:stop] if scale.shape[0] > 1 else scale
    block_rows, block_cols = weight.block
    rows = scale.repeat_interleave(block_rows, dim=0)[start:stop]
    return rows.repeat_interleave(block_cols, dim=1)[:, :in_features]


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """[out, blocks] fp32 -> [out, blocks, 2] bytes of fp16, refusing what fp16 cannot hold."""
    half = values.half()
    if not bool(torch.isfinite(half).all()):
        raise UnservableWeight("a scale is beyond fp16's range")
    return half.view(torch.uint8).view(*values.shape, 2)
