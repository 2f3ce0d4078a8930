"""A rank's part of the model (Megatron-style cuts, parallel/__init__.py): the architecture it
builds (`local_arch`), the part of each checkpoint tensor it holds (`shard_weight`,
`shard_blocks`), the vocabulary rows of its logits and their gather, and the ends (embedding,
logits) a pipeline stage lets go.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from zllm.config.parallel import check_divisible
from zllm.executor.parallel.groups import PipelineParallel, TensorParallel
from zllm.model.arch_config import ModelArchConfig


def local_arch(arch: ModelArchConfig, tp: TensorParallel) -> ModelArchConfig:
    """The architecture of one rank's model: its share of heads and of the MLP."""
    if not tp.enabled:
        return arch
    check_divisible(arch, tp.size)
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // tp.size,
        num_kv_heads=max(1, arch.num_kv_heads // tp.size),
        intermediate_size=arch.intermediate_size // tp.size,
    )


def kv_heads_of(arch: ModelArchConfig, tp: TensorParallel) -> range:
    """The KV heads this rank holds (one, shared with other ranks, when ranks outnumber them)."""
    kv = arch.num_kv_heads
    if kv >= tp.size:
        per_rank = kv // tp.size
        return range(tp.rank * per_rank, (tp.rank + 1) * per_rank)
    first = tp.rank // (tp.size // kv)
    return range(first, first + 1)


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, end) of the logits rows this rank computes; the last rank's may run short of
    the others' (the gather pads it)."""
    per_rank = vocab_per_rank(vocab_size, tp)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def vocab_per_rank(vocab_size: int, tp: TensorParallel) -> int:
    return -(-vocab_size // tp.size)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Each rank's [N, vocab_per_rank] logits (the last rank's padded) -> [N, vocab_size]."""
    if not tp.enabled:
        return local
    return tp.all_gather_columns(local)[:, :vocab_size]


def logits_weight(
    arch: ModelArchConfig, dtype: torch.dtype, tp: TensorParallel
) -> nn.Parameter | None:
    """The output embedding a model holds: none when tied to the input embedding on one rank
    (the embedding serves), else this rank's vocabulary rows (tied: copied from the embedding
    by fill_tied_logits_shard, since every rank keeps the whole input embedding)."""
    if arch.tie_word_embeddings and not tp.enabled:
        return None
    rows = vocab_per_rank(arch.vocab_size, tp)
    return nn.Parameter(torch.empty(rows, arch.hidden_size, dtype=dtype), requires_grad=False)


def fill_tied_logits_shard(
    lm_head: nn.Parameter | None, embedding: torch.Tensor, arch: ModelArchConfig, tp: TensorParallel
) -> None:
    if tp.enabled and arch.tie_word_embeddings:
        # The tied output embedding is the input embedding: cut as an lm_head would be.
        lm_head.data.copy_(shard_weight("lm_head.weight", embedding, arch, tp))


def release_weight(param: nn.Parameter) -> None:
    """Free a weight nothing here reads any more: an empty tensor, so any use fails loudly."""
    param.data = torch.empty(0, dtype=param.dtype)


def release_other_stages_ends(model: nn.Module, pp: PipelineParallel) -> bool:
    """Every stage builds the model's embedding and logits weights (the checkpoint holds them
    once); only the first stage embeds tokens and only the last computes logits, so the others
    let theirs go (SmolLM2's tied table is 113 MB in fp32, a 128K-vocabulary model's several
    GB). `model`: ours, loaded and quantized (embed_rows / logits_proj, when GGUF blocks serve
    them). Returns whether anything was released."""
    if not pp.enabled:
        return False
    if not pp.is_first:
        model.embed_rows = None
    if not pp.is_last:
        model.logits_proj = None
        if model.lm_head is not None:
            release_weight(model.lm_head)
    # One rank's tied logits read the input embedding itself (no lm_head, no GGUF blocks).
    tied_logits = pp.is_last and model.lm_head is None and model.logits_proj is None
    if not (pp.is_first or tied_logits):
        release_weight(model.embed_tokens)
    return True


# HF weight-name endings -> how the tensor is split: by output rows (column-parallel) or by
# input columns (row-parallel).
_Q = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_KV = (
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
)
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_QKV_FUSED = ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")  # Phi-3
_GATE_UP_FUSED = "mlp.gate_up_proj.weight"  # Phi-3
_LOGITS = ("lm_head.weight",)


@dataclass(frozen=True, slots=True)
class Shard:
    """A rank's part of one checkpoint tensor: `rows` (output rows, in order, concatenated)
    or `columns` (a range of input features); `pad_rows` zero rows appended (the vocabulary's
    last share)."""

    rows: tuple[slice, ...] = ()
    columns: slice | None = None
    pad_rows: int = 0


def shard_of(name: str, arch: ModelArchConfig, tp: TensorParallel) -> Shard | None:
    """How `name` (a full-model checkpoint tensor) is cut for this rank; None: replicated."""
    if not tp.enabled:
        return None
    head_dim = arch.head_dim
    q_heads = arch.num_heads // tp.size
    q_rows = slice(tp.rank * q_heads * head_dim, (tp.rank + 1) * q_heads * head_dim)
    kv = kv_heads_of(arch, tp)
    kv_rows = slice(kv.start * head_dim, kv.stop * head_dim)
    inter = arch.intermediate_size // tp.size
    inter_rows = slice(tp.rank * inter, (tp.rank + 1) * inter)
    if name.endswith(_Q):
        return Shard(rows=(q_rows,))
    if name.endswith(_KV):
        return Shard(rows=(kv_rows,))
    if name.endswith(_MLP_ROWS):
        return Shard(rows=(inter_rows,))
    if name.endswith("self_attn.o_proj.weight"):
        return Shard(columns=q_rows)
    if name.endswith("mlp.down_proj.weight"):
        return Shard(columns=inter_rows)
    if name.endswith(_QKV_FUSED):
        q_size, kv_size = arch.num_heads * head_dim, arch.num_kv_heads * head_dim
        k0, v0 = q_size, q_size + kv_size
        return Shard(
            rows=(
                q_rows,
                slice(k0 + kv_rows.start, k0 + kv_rows.stop),
                slice(v0 + kv_rows.start, v0 + kv_rows.stop),
            )
        )
    if name.endswith(_GATE_UP_FUSED):
        up0 = arch.intermediate_size
        return Shard(rows=(inter_rows, slice(up0 + inter_rows.start, up0 + inter_rows.stop)))
    if name in _LOGITS:
        start, end = vocab_rows(arch.vocab_size, tp)
        return Shard(
            rows=(slice(start, end),), pad_rows=vocab_per_rank(arch.vocab_size, tp) - (end - start)
        )
    return None  # embedding, norms, per-head q/k norms: replicated


def _take_rows(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    parts = [tensor[r] for r in shard.rows]
    if shard.pad_rows:
        parts.append(tensor.new_zeros(shard.pad_rows, *tensor.shape[1:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def shard_weight(
    name: str, tensor: torch.Tensor, arch: ModelArchConfig, tp: TensorParallel
) -> torch.Tensor:
    """The part of the (full-model) checkpoint tensor `name` that this rank holds."""
    shard = shard_of(name, arch, tp)
    if shard is None:
        return tensor
    if shard.columns is not None:
        return tensor[:, shard.columns]
    return _take_rows(tensor, shard)


def shard_blocks(
    name: str,
    blocks: torch.Tensor,
    block_values: int,
    block_bytes: int,
    arch: ModelArchConfig,
    tp: TensorParallel,
) -> torch.Tensor | None:
    """The rank's part of a GGUF-quantized matrix `blocks` [rows, bytes per row], whose rows
    hold blocks of `block_values` values in `block_bytes` bytes. Rows are cut like fp32 rows;
    a column range only on block boundaries (None when it falls inside a block: that matmul
    then keeps fp32 weights). Zero bytes dequantize to zero in every type (the padding)."""
    shard = shard_of(name, arch, tp)
    if shard is None:
        return blocks
    if shard.columns is None:
        return _take_rows(blocks, shard)
    start, stop = shard.columns.start, shard.columns.stop
    if start % block_values or stop % block_values:
        return None
    first, end = start // block_values * block_bytes, stop // block_values * block_bytes
    return blocks[:, first:end].contiguous()  # the kernels read whole rows
