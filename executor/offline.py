"""The offline `LLM`'s executors (core/executors.py's protocol): a ModelRunner in the
caller's process, alone or as rank 0 of rank processes it starts.

    InProcessExecutor     one rank: each step runs inside `submit` (with the asynchronous
                          executor: launched there, finished at the next submit or poll)
    RankProcessExecutor   N ranks (tensor x pipeline parallel): `submit` passes the step to
                          ranks 1..N-1 and runs rank 0's part here; with pipeline stages the
                          last stage answers over a socket, so submit returns before the step
                          has finished (`runs_ahead`) and the engine core keeps one step per
                          stage in flight.
"""

from __future__ import annotations

import weakref
from collections import deque

from zllm.config.engine import EngineConfig
from zllm.executor.async_steps import StepPipeline, run_step
from zllm.executor.model_runner import ModelRunner
from zllm.executor.ranks.processes import RankProcesses, join_ranks
from zllm.protocol import ModelRunnerOutput, SchedulerOutput


class InProcessExecutor:
    """One rank here. With the asynchronous executor (`async_executor`) a step is launched
    in `submit` and finished when the next one is launched or its output is polled, so the
    engine core keeps two steps out (`runs_ahead`); else each runs whole inside `submit`."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pipeline = StepPipeline(runner, runner.config.async_executor)
        self.runs_ahead = self.pipeline.overlap
        self.outputs: deque[ModelRunnerOutput] = deque()

    def submit(self, step: SchedulerOutput) -> None:
        try:
            outputs = self.pipeline.run(step)
        finally:  # (a step whose finish failed still gets its answer: StepPipeline.run)
            self.outputs.extend(self.pipeline.failed)
            self.pipeline.failed.clear()
        assert outputs or self.pipeline.pending, "one rank answers every step"
        self.outputs.extend(outputs)

    def poll(self, timeout_s: float | None) -> ModelRunnerOutput | None:
        if not self.outputs:
            try:
                self.outputs.extend(self.pipeline.drain())
            finally:
                self.outputs.extend(self.pipeline.failed)
                self.pipeline.failed.clear()
        return self.outputs.popleft() if self.outputs else None

    def close(self) -> None:
        pass


class RankProcessExecutor:
    """Rank 0 here, ranks 1..N-1 in processes (executor/ranks/processes.py RankProcesses). A step that
    fails or is interrupted here stops the ranks: they may be inside its collectives, or
    never got it, so rank 0 cannot rejoin them; later steps then say to make a new LLM."""

    def __init__(self, runner: ModelRunner, ranks: RankProcesses, pipeline_stages: int) -> None:
        self.runner = runner
        self.ranks = ranks
        # With pipeline stages the last stage answers, in a rank process.
        self.runs_ahead = pipeline_stages > 1
        self.outputs: deque[ModelRunnerOutput] = deque()

    def submit(self, step: SchedulerOutput) -> None:
        if self.ranks.closed:
            raise RuntimeError(
                "this LLM's tensor-parallel ranks were stopped after a step failed or was "
                "interrupted (they could no longer be kept in step): make a new LLM"
            )
        try:
            self.ranks.forward(step)
            output = run_step(self.runner, step)
        except BaseException:
            self.ranks.close()
            raise
        if not self.runs_ahead:
            assert output is not None, "rank 0 answers without pipeline stages"
            self.outputs.append(output)

    def poll(self, timeout_s: float | None) -> ModelRunnerOutput | None:
        if not self.runs_ahead:
            return self.outputs.popleft() if self.outputs else None
        try:
            return self.ranks.receive_output(timeout_s)
        except BaseException:
            self.ranks.close()
            raise

    def close(self) -> None:
        self.ranks.close()


def start_offline_executor(config: EngineConfig) -> InProcessExecutor | RankProcessExecutor:
    """The offline engine's executor: rank 0's ModelRunner in this process and, with several
    ranks, the processes of ranks 1..N-1 it forwards each step to (stopped when the executor
    is collected, or at exit)."""
    from zllm.runtime.procutil import free_ports

    if config.world_size == 1:
        return InProcessExecutor(ModelRunner(config))
    init_method = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    ranks = RankProcesses(config, init_method)
    try:
        ranks.wait_joining()
        runner = ModelRunner(config, join_ranks(config, 0, init_method))
    except BaseException:
        ranks.close()
        raise
    executor = RankProcessExecutor(runner, ranks, config.pipeline_parallel_size)
    weakref.finalize(executor, ranks.close)
    return executor
