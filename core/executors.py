"""What the engine core drives: an `Executor`, and the core process's one (over sockets).

`EngineCore.step(executor)` is the only schedule -> execute -> update loop in the tree. It
talks to the model through this protocol, whatever carries the steps:

    transport                       implementation                     used by
    the core's PUSH/PULL sockets    SocketExecutor (here)              core/main.py (zllm serve;
                                                                       Ray's driver relays them)
    a ModelRunner in this process   InProcessExecutor                  zllm/llm.py (offline LLM)
    rank processes (TP/PP offline)  RankProcessExecutor                zllm/llm.py, N ranks
                                    (executor/offline.py, torch)

`submit` never waits for the step to run when the executor `runs_ahead` (another process runs
it, or the asynchronous executor has only launched it: executor/async_steps.py), so the
engine core schedules step N+1 while step N runs; outputs come back from `poll` in the order
the steps were submitted, and only `EngineCore` pairs them with their steps. An executor
that runs a step whole inside `submit` (in-process, synchronous) sets `runs_ahead = False`:
the core then keeps one step out at a time.

Sleep mode travels as steps too (`SchedulerOutput(sleep_level=1|2)` / `wake_up=[parts]`,
answered like any step), so every transport sleeps the same way: `EngineCore.sleep(executor)`.
This module never imports torch.
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec
import zmq

from zllm.protocol import ModelRunnerOutput, SchedulerOutput


class ExecutorTimeout(RuntimeError):
    """Steps are out and none was answered for the executor's timeout: a stuck executor is
    as bad as a dead one (the core process exits, and the supervisor restarts the engine)."""


class Executor(Protocol):
    # True when `submit` returns before the step has finished (it runs in another process,
    # or it was launched on the device and is finished later: the asynchronous executor).
    runs_ahead: bool

    def submit(self, step: SchedulerOutput) -> None:
        """Hand a step over; never waits for it to run when `runs_ahead`."""

    def poll(self, timeout_s: float | None) -> ModelRunnerOutput | None:
        """The oldest unanswered step's output: waiting up to `timeout_s` (None: until it
        comes) and None if it has not come by then. Raises ExecutorTimeout when steps are out
        and the executor has answered none for longer than it may take."""

    def close(self) -> None:
        """Stop what the executor started (rank processes, sockets)."""


class SocketExecutor:
    """The executor process(es) of `zllm serve`, behind a PUSH socket (steps) and a PULL
    socket (outputs); with the Ray backend the executor process relays both to the actors."""

    runs_ahead = True

    def __init__(
        self, ctx: zmq.Context, executor_in: str, executor_out: str, timeout_s: float
    ) -> None:
        self.to_executor = ctx.socket(zmq.PUSH)
        self.to_executor.connect(executor_in)
        self.from_executor = ctx.socket(zmq.PULL)
        self.from_executor.connect(executor_out)
        self.timeout_s = timeout_s
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self.num_outstanding = 0
        # When the executor last made progress: its last answer, or the submit that found it
        # with nothing to do.
        self.last_progress = time.monotonic()

    def submit(self, step: SchedulerOutput) -> None:
        if not self.num_outstanding:
            self.last_progress = time.monotonic()
        self.to_executor.send(self.encoder.encode(step))
        self.num_outstanding += 1

    def poll(self, timeout_s: float | None) -> ModelRunnerOutput | None:
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        if self.from_executor.poll(int(wait_s * 1000)):
            output = self.decoder.decode(self.from_executor.recv())
            self.num_outstanding -= 1
            self.last_progress = time.monotonic()
            return output
        stuck_s = time.monotonic() - self.last_progress
        if self.num_outstanding and (timeout_s is None or stuck_s > self.timeout_s):
            raise ExecutorTimeout(
                f"no step finished for {stuck_s:.0f} s with {self.num_outstanding} step(s) out"
            )
        return None

    def close(self) -> None:
        self.to_executor.close(linger=0)
        self.from_executor.close(linger=0)
