"""A pipeline stage's two ends: the residual stream coming in, and going out.

    stage 0:   embed ──► layers 0..k ──► send ─┐
    stage 1:       ┌─ recv ◄──────────────────┘ ──► layers k+1..n ──► final norm ──► sample

With the stream goes a [stages, 2] table of each stage's (idle, busy) seconds in this step,
so the last stage can report every stage's: idle is the time before the step came and
waiting for the stage before, busy the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from zllm.executor.parallel import PipelineParallel


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

    def receive(
        self, input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The stream entering this stage's layers: the first embeds the tokens, later ones
        receive it from the stage before (waiting for it)."""
        pp = self.pp
        self._wait_s = 0.0  # for the stage before
        if pp.is_first:
            self._times = torch.zeros((pp.size, 2), dtype=torch.float64, device=self.device)
            return embed(input_ids)
        rows = (input_ids.shape[0], self.hidden_size)
        wait_start = time.perf_counter()
        stream, self._times = pp.recv(
            [rows, (pp.size, 2)], [self.dtype, torch.float64], self.device
        )
        self._wait_s = time.perf_counter() - wait_start
        return stream

    def send(
        self, out: torch.Tensor, idle_s: float, step_start: float
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Records this stage's times; all but the last stage send the stream on and return
        None, the last returns its final hidden states. Returns them with the times table."""
        pp, times = self.pp, self._times
        times[pp.stage, 0] = idle_s + self._wait_s
        times[pp.stage, 1] = time.perf_counter() - step_start - self._wait_s
        if pp.is_last:
            return out, times.cpu()
        for work, _ in self._sends:  # the last step's: its tensors may be freed now
            work.wait()
        tensors = [out, times]
        self._sends = list(zip(pp.send(tensors), tensors, strict=True))
        return None, times
