"""A mixture-of-experts layer's expert matrices read from weight blocks (blocks.py does the
dense matmuls; this, the experts' ExpertMatrices in executor/layers/moe/).

A GGUF file stacks each projection of a layer's experts in one 3-D tensor (llama.cpp's
blk.N.ffn_{gate,up,down}_exps, [E, out, in] in blocks), which the loader hands over as its
E x out rows of blocks under our stacked name (mlp.experts.gate_proj.weight). A bf16/fp16
checkpoint holds each expert's matrix on its own (mlp.experts.{e}.gate_proj.weight), as 16-bit
rows. Either way the experts' rows become one [E, rows, bytes per row] tensor per part, which
ExpertMatrices multiplies through the CPU kernel one expert's view at a time: the blocks are
never widened. gate and up of one type are joined into [E, 2 x intermediate, bytes] (one
kernel call per expert); of different types, they stay two parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.experts import ExpertMatrices

if TYPE_CHECKING:
    from zllm.executor.weights.blocks import _WeightBlocks

# One candidate naming of a projection: per part (gate, up; or down), the checkpoint names
# whose rows make it (one stacked name, or every expert's own).
Candidate = list[list[str]]


# Mixtral checkpoints' names of each expert's projections (block_sparse_moe.experts.{e}.w1 ...).
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_matmul_targets(model: nn.Module) -> Iterator[tuple[ExpertMatrices, list[Candidate]]]:
    """Each sparse layer's two expert projections with the namings that may hold them: a GGUF
    file's stacked tensors, then each expert's own (a checkpoint's; Mixtral's names)."""
    for i, layer in zip(model.layer_indices, model.layers, strict=True):
        mlp = getattr(layer, "mlp", None)  # (Nemotron-H's layers have one mixer, no mlp)
        if not isinstance(mlp, MoEBlock):
            continue
        first = ("gate_proj", "up_proj") if mlp.rule.gated else ("up_proj",)
        yield mlp.experts_gate_up, _namings(i, mlp.num_experts, first)
        yield mlp.experts_down, _namings(i, mlp.num_experts, ("down_proj",))


def _namings(layer: int, num_experts: int, projections: tuple[str, ...]) -> list[Candidate]:
    p, experts = f"model.layers.{layer}.", range(num_experts)
    stacked = [[f"{p}mlp.experts.{proj}.weight"] for proj in projections]
    own = [[f"{p}mlp.experts.{e}.{proj}.weight" for e in experts] for proj in projections]
    mixtral = [
        [f"{p}block_sparse_moe.experts.{e}.{_MIXTRAL[proj]}.weight" for e in experts]
        for proj in projections
    ]
    return [stacked, own, mixtral]


def _chosen(candidates: list[Candidate], reads: Callable[[list[str]], bool]) -> Candidate | None:
    """The first naming whose every tensor the kernel reads."""
    return next((c for c in candidates if reads([n for part in c for n in part])), None)


def served_names(model: nn.Module, reads: Callable[[list[str]], bool]) -> set[str]:
    """The checkpoint names whose tensors swap_experts_ will serve from blocks."""
    served: set[str] = set()
    for _, candidates in expert_matmul_targets(model):
        chosen = _chosen(candidates, reads)
        if chosen is not None:
            served.update(n for part in chosen for n in part)
    return served


def swap_experts_(model: nn.Module, source: _WeightBlocks) -> tuple[int, int]:
    """Every expert projection whose blocks the kernel reads holds them from now on; returns
    how many were swapped and how many keep their float weights."""
    swapped = kept = 0
    for experts, candidates in expert_matmul_targets(model):
        chosen = _chosen(candidates, source.reads)
        if chosen is None:
            kept += 1
            continue
        parts = [_stacked_rows(source, names, experts.num_experts) for names in chosen]
        _check_shape(chosen, parts, experts)
        if source.verify:
            _check(source, chosen, parts, experts)
        source.served.update(n for names in chosen for n in names)
        experts.hold_blocks_(_merged(parts), source.arithmetic)
        swapped += 1
    return swapped, kept


def _stacked_rows(
    source: _WeightBlocks, names: list[str], num_experts: int
) -> tuple[int, torch.Tensor]:
    """(ggml type, [E, rows, bytes per row]) from one stacked tensor's rows or E experts'."""
    if source.input_order(names) is not None:  # act-order: each expert's columns scattered
        raise ValueError(
            f"{names[0]}: act-order (g_idx) expert weights are not served (the grouped expert "
            f"matmuls read x in natural order); quantize the experts without act-order"
        )
    found = [source.rank_part(n) for n in names]
    types = {ggml_type for ggml_type, _ in found}
    if len(types) != 1:
        raise ValueError(f"the experts of {names[0]} are stored in different types")
    if len(found) == 1:
        rows = found[0][1]
        return found[0][0], rows.view(num_experts, -1, rows.shape[-1])
    return found[0][0], torch.stack([rows for _, rows in found])


def _check_shape(
    chosen: Candidate, parts: list[tuple[int, torch.Tensor]], experts: ExpertMatrices
) -> None:
    """Refuse (ValueError) experts' blocks that are not the layer's matrices."""
    rows = sum(part.shape[1] for _, part in parts)
    for names, (ggml_type, part) in zip(chosen, parts, strict=True):
        row_bytes = cpu_kernels.row_bytes(ggml_type, experts.in_features)
        if part.shape[2] != row_bytes or rows != experts.out_features:
            raise ValueError(
                f"{names[0]}: the checkpoint's experts are {part.shape[1]} rows of "
                f"{part.shape[2]} bytes each; this layer's are [{experts.out_features}, "
                f"{experts.in_features}]"
            )


def _merged(parts: list[tuple[int, torch.Tensor]]) -> list[tuple[torch.Tensor, int]]:
    """Runs of one type joined along the rows of each expert (gate and up: one matmul)."""
    merged: list[tuple[torch.Tensor, int]] = []
    for ggml_type, rows in parts:
        if merged and merged[-1][1] == ggml_type:
            merged[-1] = (torch.cat([merged[-1][0], rows], dim=1), ggml_type)
        else:
            merged.append((rows, ggml_type))
    return merged


def _check(
    source: _WeightBlocks,
    chosen: Candidate,
    parts: list[tuple[int, torch.Tensor]],
    experts: ExpertMatrices,
) -> None:
    """The blocks must dequantize to exactly the float weights the model loaded."""
    assert experts.weight is not None
    start = 0
    for names, (ggml_type, rows) in zip(chosen, parts, strict=True):
        count = rows.shape[1]
        loaded = experts.weight.data[:, start : start + count].reshape(-1, experts.in_features)
        source.check_rows(names[0], ggml_type, rows.reshape(-1, rows.shape[-1]), loaded)
        start += count
