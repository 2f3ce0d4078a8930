"""The asynchronous executor: step N+1 is launched before step N's tokens reach the host.

On a GPU a step's kernels are only queued by the Python that launches them. Run one step at
a time and the GPU idles while the executor builds the next step's inputs, waits for the
sampled ids and packs the output (issue 41 measured ~1.2 ms of a 2.5 ms SmolLM2 step). Here
the executor launches step N (inputs, forward, sampling, a non-blocking copy of the sampled
ids into pinned host memory), then, when step N+1 is already waiting (the core schedules
ahead: core/executors.py), launches it too before it finishes N:

    host   launch N ─ launch N+1 ─ finish N (wait for N's copy, pack, send) ─ launch N+2 ─ ...
    GPU     ──── N ──────────── N+1 ─────────────────────────── N+2 ────────
                 └ sampled ids ─┘ fed to N+1 on the device (pending tokens)

A request sampled in N and scheduled again in N+1 has its N token only on the device when
N+1's inputs are built: `RequestState.num_pending` counts it, `prepare_inputs` leaves its
slot to `PendingTokens.fill` (step_inputs.py), which copies it from N's sampled ids on the
device (a launched step, launched_step.py, holds them).

What may overlap (everything else runs one step at a time, as before):
- A step stays pending only when none of its sampled requests needs its own output tokens
  on the host to sample its next one (`needs_host_tokens`: penalties, min_tokens still
  binding, bad words, structured output, a thinking budget, beam search, several samples
  at once) and the runner has one rank and no speculation.
- A step is launched over a pending one only when it is plain: no sleep or wake-up, forks,
  beam tokens, KV tier transfers, block copies, proposals or resumed (preempted) requests.

On CPU the kernels run on the calling thread, so nothing overlaps: `--async-executor auto`
leaves it off there. Turned on (the tests do), the same launch-then-finish order and pending
tokens run on CPU tensors, which is how the CPU suite checks this path equals one step at a
time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from zllm.executor.launched_step import LaunchedStep
from zllm.executor.requests.state import RequestState
from zllm.protocol import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from zllm.executor.model_runner import ModelRunner


def needs_host_tokens(st: RequestState, num_samples: int = 1) -> bool:
    """Whether sampling `st`'s next token reads its output tokens on the host (so the step
    that sampled its last one must finish first): penalties over the output, a min_tokens
    that still binds, bad words, a grammar, a thinking budget, beam search, or several
    samples drawn at once (the core forks them from the output)."""
    params = st.sampling_params
    return (
        num_samples > 1
        or params.use_beam_search
        or params.penalizes_output
        or len(st.output_token_ids) < params.min_tokens
        or bool(params.bad_words_token_ids)
        or st.grammar is not None
        or st.thinking is not None
    )


def is_plain(so: SchedulerOutput) -> bool:
    """Whether a step may be launched while another one is pending, and may be left pending:
    nothing in it reads or changes state the pending step has not settled yet."""
    return not (
        so.wake_up
        or so.sleep_level
        or so.forked_requests
        or so.beam_tokens
        or so.kv_transfers is not None
        or so.blocks_to_copy
        or so.spec_token_ids
        or so.speculate
        or any(cached.resumed for cached in so.cached_requests)
    )


def may_stay_pending(launched: LaunchedStep) -> bool:
    """Whether `launched` may stay unfinished while the next step is launched."""
    if launched.output is not None or not is_plain(launched.so):
        return False
    rows = launched.rows
    if rows is None:
        return True
    num_samples = launched.so.num_samples
    return not any(needs_host_tokens(st, num_samples.get(st.req_id, 1)) for st in rows.requests)


def run_step(runner: ModelRunner, step: SchedulerOutput) -> ModelRunnerOutput | None:
    """One step as every rank runs it, start to finish: waking first or sleeping after when
    the core says."""
    if step.wake_up:
        runner.wake_up(step.wake_up)
    output = runner.execute_model(step)
    if step.sleep_level:
        runner.sleep(step.sleep_level)
    return output


class StepPipeline:
    """Runs steps on a ModelRunner, at most one of them pending: `run(step)` returns the
    outputs finished by it, in step order; `drain()` finishes the pending one. With
    `overlap` False every step is finished before `run` returns (the synchronous executor).

    Each output's `exec_time_s` is the time it alone held the executor (from its launch, or
    the previous output's finish if later, to its own finish), so the overlapped steps' busy
    times add up to wall time, not more."""

    def __init__(self, runner: ModelRunner, overlap: bool) -> None:
        self.runner = runner
        self.overlap = overlap and runner.can_overlap_steps
        self.pending: LaunchedStep | None = None
        self.num_overlapped = 0  # steps launched while another was pending
        # Answers for steps whose finish failed (an error, Ctrl-C): see _finish.
        self.failed: list[ModelRunnerOutput] = []
        self._last_finish = time.perf_counter()

    def run(self, step: SchedulerOutput, idle_s: float = 0.0) -> list[ModelRunnerOutput]:
        """`idle_s`: how long the executor waited for `step` (its output carries it).

        If finishing the pending step raises after `step` was launched, `step` is dropped
        (the caller treats a step whose submit raised as never run and aborts its requests)
        and the pending step's answer is an empty output in `failed`."""
        done: list[ModelRunnerOutput] = []
        if self.pending is not None and not is_plain(step):
            done.append(self.drain_one())
        if step.wake_up or step.sleep_level:
            done.extend(self._run_control(step))
            return done
        started = time.perf_counter()
        overlapped = self.pending is not None
        launched = self.runner.launch(step, self.pending)
        if overlapped:
            self.num_overlapped += 1
            done.append(self.drain_one())
        if launched is None:  # a pipeline stage before the last: passed on
            return done
        launched.step_start = started
        launched.idle_s = idle_s
        launched.overlapped = overlapped
        if self.overlap and may_stay_pending(launched):
            self.pending = launched
        else:
            done.append(self._finish(launched))
        return done

    def drain(self) -> list[ModelRunnerOutput]:
        return [] if self.pending is None else [self.drain_one()]

    def drain_one(self) -> ModelRunnerOutput:
        assert self.pending is not None
        launched, self.pending = self.pending, None
        return self._finish(launched)

    def _finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        try:
            output = self.runner.finish(launched)
        except BaseException:
            # The engine core still waits for this step's answer: an empty one keeps steps
            # and answers paired, while the caller aborts the requests (LLM._run). Its
            # requests' tokens may be half appended, so they are not for running on.
            so = launched.so
            self.failed.append(
                ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[])
            )
            raise
        output.overlapped = launched.overlapped
        output.idle_time_s = launched.idle_s
        now = time.perf_counter()
        output.exec_time_s = now - max(launched.step_start, self._last_finish)
        self._last_finish = now
        return output

    def _run_control(self, step: SchedulerOutput) -> list[ModelRunnerOutput]:
        """A sleep or wake-up step, alone (nothing is pending by now)."""
        started = time.perf_counter()
        output = run_step(self.runner, step)
        if output is None:
            return []
        now = time.perf_counter()
        output.exec_time_s = now - max(started, self._last_finish)
        self._last_finish = now
        return [output]
