"""The executor's ranks as torch.distributed groups: this process's tensor-parallel rank and
pipeline stage (`TensorParallel`, `PipelineParallel`, `Parallel`), the collectives between
them, and `init_parallel`, which joins a rank to both (the room's docstring, parallel/__init__.py,
says how a model is split).

Only the all-reduce order differs from one rank: the sums are over N partial products instead
of one, so outputs can differ from a single rank's in the last bits (the parity tests allow
near-ties). Every rank ends a collective with the same bits (gloo and NCCL reduce each element
in one place, then broadcast it), which keeps the ranks' sampling in step.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zllm.config.parallel import stage_layers

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
