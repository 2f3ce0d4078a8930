"""A pipeline stage's two ends: the residual stream coming in, and going out.

    stage 0:   embed ──► layers 0..k ──► send ─┐
    stage 1:       ┌─ recv ◄──────────────────┘ ──► layers k+1..n ──► final norm ──► sample

With the stream goes a [stages, 2] table of each stage's (idle, busy) seconds in this step,
so the last stage can report every stage's: idle is the time before the step came and
waiting for the stage before, busy the rest.

A step with KV loads (the tiers', a consumer's received blocks) also carries a [loads] mask
of those that failed: each stage loads its own layers' part of every block, so a load can
fail on one stage alone (a damaged file of its part; its part dropped from a full buffer).
Each stage ORs its own failures into the mask it received, and the last stage reports the
union to the core (`failed_loads`), which forgets those copies. No stage ever recomputes a
failed load in its step (stage 0 has run its layers by the time stage s finds one): the
core sends fallible loads only in a step of their own, in which the request they are for
computes nothing (core/kv/prefetch.py). Such a step may have no request computing at all,
and then the mask goes down the pipeline alone (`pass_failures`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from zllm.executor.parallel.groups import PipelineParallel

Load = tuple[int, bytes, int]  # (tier, block hash, pool block id), as KVTransfers.loads holds


def failure_mask(
    loads: Sequence[Load], failures: Sequence[Load], device: torch.device
) -> torch.Tensor:
    """[len(loads)] uint8: 1 at each of the step's loads that is among `failures` (this
    stage's ranks' union of the loads that failed)."""
    failed = set(failures)
    return torch.tensor([tuple(load) in failed for load in loads], dtype=torch.uint8, device=device)


def failed_loads(loads: Sequence[Load], mask: torch.Tensor) -> list[tuple[int, bytes]]:
    """The (tier, block hash) of each load `mask` marks failed, each once, in load order:
    what the core forgets (ModelRunnerOutput.kv_load_failed)."""
    failed: dict[tuple[int, bytes], None] = {}
    for (tier, block_hash, _), bad in zip(loads, mask.tolist(), strict=True):
        if bad:
            failed[(tier, block_hash)] = None
    return list(failed)


class PipelineStage:
    """This rank's stage: receives (or embeds) the stream, passes it on without waiting."""

    def __init__(
        self, pp: PipelineParallel, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.pp = pp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        # This stage's sends still in flight (the tensors they read).
        self._sends: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        self._times = torch.zeros(0)
        self._wait_s = 0.0
        # This step's loads, and the mask of those that failed on this stage or before it
        # (most steps load nothing: one empty mask for them, not a new tensor each step).
        self._no_loads = torch.zeros(0, dtype=torch.uint8, device=device)
        self._loads: Sequence[Load] = []
        self._failed = self._no_loads

    def loads_failed(self, loads: Sequence[Load], failures: Sequence[Load]) -> None:
        """This step's KV loads, and those that failed on this stage (its ranks' union):
        the mask that goes down the pipeline with the step."""
        self._loads = loads
        self._failed = failure_mask(loads, failures, self.device) if loads else self._no_loads

    def failed_loads(self) -> list[tuple[int, bytes]]:
        """The last stage, once the step came down: the loads that failed on any stage."""
        return failed_loads(self._loads, self._failed.cpu())

    def receive(
        self, input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The stream entering this stage's layers: the first embeds the tokens, later ones
        receive it from the stage before (waiting for it), with the times table and the
        failure mask, into which this stage's own failures go."""
        pp = self.pp
        self._wait_s = 0.0  # for the stage before
        if pp.is_first:
            self._times = torch.zeros((pp.size, 2), dtype=torch.float64, device=self.device)
            return embed(input_ids)
        shapes = [(input_ids.shape[0], self.hidden_size), (pp.size, 2)]
        dtypes = [self.dtype, torch.float64]
        if self._failed.numel():
            shapes.append(tuple(self._failed.shape))
            dtypes.append(torch.uint8)
        wait_start = time.perf_counter()
        received = pp.recv(shapes, dtypes, self.device)
        self._wait_s = time.perf_counter() - wait_start
        stream, self._times = received[0], received[1]
        if self._failed.numel():
            self._failed = self._failed | received[2]
        return stream

    def send(
        self, out: torch.Tensor, idle_s: float, step_start: float
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Records this stage's times; all but the last stage send the stream on (with the
        failure mask) and return None, the last returns its final hidden states. Returns
        them with the times table."""
        pp, times = self.pp, self._times
        times[pp.stage, 0] = idle_s + self._wait_s
        times[pp.stage, 1] = time.perf_counter() - step_start - self._wait_s
        if pp.is_last:
            return out, times.cpu()
        self._send([out, times, self._failed] if self._failed.numel() else [out, times])
        return None, times

    def pass_failures(self) -> None:
        """A step in which no request computes (no stream): its loads' failure mask alone
        goes down the pipeline, each stage ORing its own in (the stages' ranks all run
        every step, so each pair of stages exchanges it in step order)."""
        if not self._failed.numel():
            return
        if not self.pp.is_first:
            (before,) = self.pp.recv([tuple(self._failed.shape)], [torch.uint8], self.device)
            self._failed = self._failed | before
        if not self.pp.is_last:
            self._send([self._failed])

    def _send(self, tensors: list[torch.Tensor]) -> None:
        """Start sending `tensors` to the next stage, keeping them until they are sent."""
        for work, _ in self._sends:  # the last step's: its tensors may be freed now
            work.wait()
        self._sends = list(zip(self.pp.send(tensors), tensors, strict=True))
