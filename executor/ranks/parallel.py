"""Tensor and pipeline parallelism: which part of the model a rank holds, and what passes
between ranks.

A model split over N ranks (Megatron-style, as vLLM and nano-vllm do it):

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads' / its slice of the
                             intermediate outputs; no communication
    o_proj, down_proj        row-parallel: each rank multiplies its slice of the inputs; the
                             partial sums are added across ranks (one all-reduce per layer half)
    logits                   the vocabulary split by rows; all-gathered so every rank holds the
                             whole row and samples the same token from the same bits
    embedding, norms         replicated

KV heads are split like query heads; with more ranks than KV heads, each KV head is replicated
on the N / num_kv_heads ranks whose query heads read it. A rank's model is an ordinary model
built from `local_arch` (its head and intermediate counts), so attention, the KV cache and its
sizing need no change; `shard_weight` cuts each checkpoint tensor to the rank's part.

Pipeline parallelism splits the layers into stages (zllm/config/parallel.py `stage_layers`),
each stage's ranks a tensor-parallel group of their own; a stage's model holds only its
layers (`PipelineParallel.layers`) and passes the residual stream to the next stage point to
point (`send` / `recv`). `init_parallel` joins a rank to both.

Only the all-reduce order differs from one rank: the sums are over N partial products instead
of one, so outputs can differ from a single rank's in the last bits (the parity tests allow
near-ties). Every rank ends a collective with the same bits (gloo and NCCL reduce each element
in one place, then broadcast it), which keeps the ranks' sampling in step.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zllm.config.parallel import check_divisible, stage_layers
from zllm.model.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's rank among `size` tensor-parallel ranks (size 1: no parallelism).
    With pipeline stages too, the ranks of one stage form `group`; None: every rank."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def union_across(self, items: list) -> list:
        """Every rank's items (picklable, hashable) together, sorted: what the ranks agree
        on after each found its own (e.g. the KV loads that failed on any rank)."""
        if self.size == 1:
            return sorted(set(items))
        gathered: list[list | None] = [None] * self.size
        dist.all_gather_object(gathered, items, group=self.group)
        return sorted({item for part in gathered for item in part or []})

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, c] on each rank -> [rows, size * c], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class PipelineParallel:
    """This process's pipeline stage among `size` (size 1: the whole model). A stage holds
    the decoder layers `layers` (None: all); the first embeds the tokens, the last applies
    the final norm, computes the logits and samples. Between stages the residual stream
    goes point to point, from each tensor-parallel rank to the same one of the next stage
    (every rank of a stage holds the whole stream after its all-reduces)."""

    stage: int = 0
    size: int = 1
    layers: range | None = None
    prev_rank: int | None = None  # global ranks of the neighbours (None: none)
    next_rank: int | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers

    def send(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        """Start sending `tensors` to the next stage; the caller keeps them (and waits on the
        returned works) until sent."""
        assert self.next_rank is not None
        return [dist.isend(t.contiguous(), self.next_rank) for t in tensors]

    def recv(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], device) -> list:
        """The tensors the stage before sends, in order (blocking)."""
        assert self.prev_rank is not None
        out = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes, strict=True)]
        for t in out:
            dist.recv(t, self.prev_rank)
        return out


WHOLE = PipelineParallel()


@dataclass(frozen=True, slots=True)
class Parallel:
    """This executor process's place among all of an engine's ranks."""

    rank: int = 0
    world_size: int = 1
    tp: TensorParallel = SINGLE
    pp: PipelineParallel = WHOLE

    @property
    def answers(self) -> bool:
        """Whether this rank sends the step's output (the last stage's first rank)."""
        return self.pp.is_last and self.tp.rank == 0

    def min_across(self, value: int) -> int:
        """The smallest of every rank's `value` (one number all ranks must agree on)."""
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


ONE_RANK = Parallel()


def init_parallel(
    rank: int,
    init_method: str,
    device: str,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    num_layers: int = 1,
    engines: int = 1,
    engine: int = 0,
) -> Parallel:
    """Join the process group of `tp_size x pp_size` ranks (gloo on CPU, NCCL on CUDA);
    returns this rank's place in it. Rank r is tensor-parallel rank r % tp_size of stage
    r // tp_size. `engines`: the data-parallel engines on this host, of which this rank's is
    `engine`: each engine's ranks take the next GPUs, or their share of the CPU cores."""
    world = tp_size * pp_size
    _place_on_device(device, engine * world + rank, world * engines)
    if world == 1:
        return ONE_RANK
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not init_method:
        raise RuntimeError(f"executor rank {rank}: no rendezvous address was given")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        # How long a rank waits for the others, at the rendezvous and at each collective:
        # long enough for a slow rank to load a large model before the first step.
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    stage, tp_rank = divmod(rank, tp_size)
    group = _tensor_parallel_group(stage, tp_size, pp_size)
    pp = WHOLE
    if pp_size > 1:
        pp = PipelineParallel(
            stage=stage,
            size=pp_size,
            layers=stage_layers(num_layers, pp_size, stage),
            prev_rank=rank - tp_size if stage > 0 else None,
            next_rank=rank + tp_size if stage < pp_size - 1 else None,
        )
    logger.info(
        "executor rank %d of %d joined (%s, %d threads): tensor-parallel rank %d of %d, "
        "pipeline stage %d of %d",
        rank,
        world,
        backend,
        torch.get_num_threads(),
        tp_rank,
        tp_size,
        stage,
        pp_size,
    )
    return Parallel(rank, world, TensorParallel(tp_rank, tp_size, group), pp)


def _place_on_device(device: str, slot: int, num_processes: int) -> None:
    """A rank's GPU (`slot` among this host's ranks of every engine), or its share of the
    CPU cores among `num_processes`."""
    if device == "cuda":
        # One GPU per rank (ranks on one host; more ranks than GPUs share them round-robin).
        torch.cuda.set_device(slot % torch.cuda.device_count())
    elif (
        not device.startswith("cuda") and num_processes > 1 and "OMP_NUM_THREADS" not in os.environ
    ):
        # The processes share this machine's cores: one thread pool each of a core per core
        # would oversubscribe them N-fold (torch sizes its pool to every core by default).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // num_processes))


def _tensor_parallel_group(stage: int, tp_size: int, pp_size: int) -> dist.ProcessGroup | None:
    """The group of this stage's ranks (None: the whole world is one stage)."""
    group = None
    if pp_size > 1 and tp_size > 1:
        # Every rank creates every stage's group, in the same order (torch.distributed's rule).
        for s in range(pp_size):
            g = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                group = g
    return group


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
