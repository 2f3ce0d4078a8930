"""A step launched on the device and not yet finished (executor/async_steps.py says when
steps overlap): what `ModelRunner.launch` queued, and what `ModelRunner.finish` turns into the
step's output once the device is done.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from zllm.executor.sample.rows import SampleRows
from zllm.executor.sample.sampler import SamplerOutput
from zllm.executor.step_inputs import PendingTokens, StepInputs
from zllm.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device; `ModelRunner.finish` turns it into its
    output. `output` is already set when there was nothing to sample (a step of an asleep
    engine, or one without runnable requests)."""

    so: SchedulerOutput
    output: ModelRunnerOutput | None = None
    inputs: StepInputs | None = None
    rows: SampleRows | None = None
    sampled: SamplerOutput | None = None  # on the host once `gpu_end` has completed
    device_token_ids: torch.Tensor | None = None  # the sampled ids on the device
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    load_failures: list[tuple[int, bytes, int]] = field(default_factory=list)
    stage_times: torch.Tensor | None = None
    gpu_start: torch.cuda.Event | None = None
    gpu_end: torch.cuda.Event | None = None  # after the step's last queued work (host copies)
    step_start: float = 0.0
    idle_s: float = 0.0  # the executor's wait for this step (serve_steps)
    overlapped: bool = False  # launched while the step before it was unfinished
    forward_start: float = 0.0
    forward_end: float = 0.0
    launched_end: float = 0.0

    def is_done(self) -> bool:
        """Whether the device has finished the step (always, on CPU)."""
        return self.gpu_end is None or self.gpu_end.query()

    def pending_tokens(self) -> PendingTokens | None:
        """The tokens this step sampled, for the next step's inputs (built when asked)."""
        if self.rows is None or self.device_token_ids is None:
            return None
        rows = {st.req_id: i for i, st in enumerate(self.rows.row_states)}
        return PendingTokens(rows, self.device_token_ids)


def copy_to_host(sampled: SamplerOutput) -> SamplerOutput:
    """The sampler's tensors as host tensors: on a GPU, non-blocking copies into pinned
    memory (complete once an event recorded after them has); on CPU the tensors themselves."""
    if sampled.sampled_token_ids.device.type != "cuda":
        return sampled

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return copy.copy_(tensor, non_blocking=True)

    names = [f.name for f in dataclasses.fields(sampled)]
    return SamplerOutput(**{name: host(getattr(sampled, name)) for name in names})
