"""How long the GPU sat idle between two steps (ModelRunnerOutput.gpu_idle_time_s)."""

from __future__ import annotations

import torch


class GpuIdleClock:
    """CUDA events around each step's kernels; on CPU every reading is 0."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # An event after the last step's final kernel.
        self._gpu_done: torch.cuda.Event | None = None
        # The stream the steps launch on (the device's default: the executor enters no
        # other around a step; graphs are captured on their own stream but replayed here),
        # looked up once: torch's lookup per record cost ~10 us, twice a step, on a path
        # whose budget at batch 1 is ~1 ms.
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def record(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def idle_before(
        self,
        start: torch.cuda.Event | None,
        end: torch.cuda.Event | None,
        after_no_work: bool,
    ) -> float:
        """Seconds the GPU had nothing to run between the last step's final kernel and this
        step's first one (0 on CPU, and after a wait for work). Events are timestamped when
        the GPU reaches them, so the gap is the GPU's own, the executor's Python between the
        two included. This step has synced by now, so `start` is complete."""
        previous, self._gpu_done = self._gpu_done, end
        if start is None or previous is None or after_no_work:
            return 0.0
        return max(0.0, previous.elapsed_time(start) / 1000)
