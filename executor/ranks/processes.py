"""Executor ranks as processes: rank 0 forwards every step to the others.

    core ──SchedulerOutput──► rank 0 ──the same frame──► rank 1 .. N-1   (ZeroMQ PUSH/PULL)
                               │                          │
                               └── collectives, stage to stage sends (torch.distributed) ──┘
    answering rank ──ModelRunnerOutput──► core          (the others answer no one)

Rank 0 passes the message on before decoding it, so the ranks start a step together; every
rank then runs the same `ModelRunner.execute_model` on its part of the model, meeting the
others in each layer's collectives (tensor parallel) or waiting for the stage before
(pipeline parallel: a stage that has passed its part on goes to the next step at once, so
stages work on different steps). The answering rank is rank 0, or with pipeline stages the
last stage's first rank. PUSH/PULL (not PUB/SUB) so a message sent before a rank has
connected waits for it instead of being lost.

In `zllm serve` the supervisor starts every rank as an executor process (executor/main.py).
The offline `LLM` runs rank 0 in its own process and starts the others here
(`RankProcesses`, driven by executor/offline.py's RankProcessExecutor); with pipeline stages
the last stage's answer comes back to it over a socket (`RankProcesses.receive_output`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Event as EventType
from typing import TYPE_CHECKING

import msgspec
import zmq

from zllm.config.engine import EngineConfig
from zllm.executor.async_steps import StepPipeline
from zllm.executor.launched_step import LaunchedStep
from zllm.protocol import ModelRunnerOutput, SchedulerOutput
from zllm.runtime.heap_trim import IdleTrim
from zllm.runtime.messaging import decode_or_drop

if TYPE_CHECKING:
    from zllm.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class StepFanout:
    """Rank 0's sockets to the other ranks: each step's frame, as received."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str]) -> None:
        self.sockets = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.bind(endpoint)
            self.sockets.append(sock)

    @classmethod
    def on_random_ports(cls, ctx: zmq.Context, host: str, count: int) -> tuple[StepFanout, list]:
        """`count` sockets bound on free TCP ports of `host` (ranks on other machines), and
        the addresses they connect to."""
        fanout = cls(ctx, [])
        addresses = []
        for _ in range(count):
            sock = ctx.socket(zmq.PUSH)
            addresses.append(f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}")
            fanout.sockets.append(sock)
        return fanout, addresses

    def forward(self, frame: zmq.Frame | bytes) -> None:
        for sock in self.sockets:
            sock.send(frame, copy=False)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def serve_steps(
    runner: ModelRunner,
    inbox: zmq.Socket,
    fanout: StepFanout | None = None,
    outbox: zmq.Socket | None = None,
) -> None:
    """Run every step that arrives, forever. Rank 0 first passes each on to the other ranks
    (`fanout`); the answering rank sends the outputs (`outbox`), in step order, with the
    wait before each (exec times: async_steps.StepPipeline).

    With the asynchronous executor (`--async-executor`) a launched step is finished only
    when the next one is launched or the device is done with it and no step is waiting:
    while it runs, the loop watches for the next step's message.

    After a second without a step, the steps' freed memory goes back to the system
    (zllm/runtime/heap_trim.py: glibc's heap keeps it otherwise, and grows with new peaks)."""
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    pipeline = StepPipeline(runner, runner.config.async_executor)
    idle_trim = IdleTrim()

    def send(outputs: list[ModelRunnerOutput]) -> None:
        for output in outputs:
            if outbox is not None:
                outbox.send(encoder.encode(output))

    idle_since = time.perf_counter()
    while True:
        if pipeline.pending is not None and not _step_waiting(inbox, pipeline.pending):
            send(pipeline.drain())
            idle_since = time.perf_counter()
        idle_trim.wait(inbox)
        frame = inbox.recv(copy=False)
        start = time.perf_counter()
        if fanout is not None:
            fanout.forward(frame)  # the other ranks start the step with this one
        step = decode_or_drop(decoder, frame.buffer, logger)
        if step is None:
            continue  # (every rank got the same frame: all drop it)
        idle_s = 0.0 if step.after_no_work or pipeline.pending else start - idle_since
        send(pipeline.run(step, idle_s))
        idle_trim.worked()
        if pipeline.pending is None:
            idle_since = time.perf_counter()


# How long `_step_waiting` spins before it sleeps between looks: a GPU decode step is ~1-3
# ms, so the next step usually comes (or the device finishes) within it; past it (a long
# prefill) a look every ~50 us leaves the core's and the frontend's processes their CPU.
SPIN_S = 200e-6
NAP_S = 50e-6


def _step_waiting(inbox: zmq.Socket, launched: LaunchedStep) -> bool:
    """Wait until the next step's message is here (True) or the device has finished
    `launched` (False: nothing to overlap it with). ZeroMQ's poll resolves milliseconds
    only, too coarse for a step: the socket and the device's event are looked at in turn."""
    spin_until = time.perf_counter() + SPIN_S
    while not inbox.poll(0):
        if launched.is_done():
            return bool(inbox.poll(0))
        if time.perf_counter() > spin_until:
            time.sleep(NAP_S)
    return True


def rank_start_context() -> multiprocessing.context.BaseContext:
    """How the offline engine starts its rank processes: forked from a forkserver that has
    imported torch once (a rank then starts in a fraction of a second, where a fresh
    interpreter spends ~2 s of a 2-core machine importing torch), never forked from the
    caller, whose threads, locks or CUDA context a fork would copy half-made; `spawn`
    where the platform has no forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def _rank_process(
    environment: dict[str, str],
    config_bytes: bytes,
    rank: int,
    init_method: str,
    endpoint: str,
    output_endpoint: str,
    joining: EventType,
) -> None:
    """Entry of an offline rank process. `environment`: the caller's, as it is when the ranks
    start (the forkserver keeps the one it started with), applied before zllm reads any of it.
    """
    os.environ.clear()
    os.environ.update(environment)
    from zllm.runtime.procutil import die_with_parent, title_process

    die_with_parent()
    title_process(f"zllm: executor {rank}")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(endpoint)
    from zllm.executor.model_runner import ModelRunner

    joining.set()  # rank 0 joins the group once every rank is this far (RankProcesses.wait_joining)
    parallel = join_ranks(config, rank, init_method)
    outbox = None
    if parallel.answers:  # the last pipeline stage's first rank
        outbox = ctx.socket(zmq.PUSH)
        outbox.connect(output_endpoint)
    serve_steps(ModelRunner(config, parallel), inbox, outbox=outbox)


def join_ranks(
    config: EngineConfig, rank: int, init_method: str, engines: int = 1, engine: int = 0
):
    """This rank's place among the engine's ranks (executor/parallel/groups.py init_parallel), as
    every kind of rank process joins: the server's, the offline engine's, Ray actors."""
    from zllm.executor.parallel.groups import init_parallel

    return init_parallel(
        rank,
        init_method,
        config.device,
        tp_size=config.tensor_parallel_size,
        pp_size=config.pipeline_parallel_size,
        num_layers=config.arch.num_layers,
        engines=engines,
        engine=engine,
    )


class RankProcesses:
    """The offline engine's ranks 1..N-1 (rank 0 is the caller's ModelRunner): started
    here, fed through `fanout`, killed with `close` or when this process dies. With pipeline
    stages the answering rank is one of them: its outputs arrive on `outputs`."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        size = config.world_size
        self.closed = False
        self.run_dir = run_dir = _private_dir()
        self.encoder = msgspec.msgpack.Encoder()
        self.endpoints = [f"ipc://{run_dir}/executor_rank_{r}" for r in range(1, size)]
        ctx = zmq.Context.instance()
        self.fanout = StepFanout(ctx, self.endpoints)
        output_endpoint = f"ipc://{run_dir}/executor_out"
        self.outputs = ctx.socket(zmq.PULL)
        self.outputs.bind(output_endpoint)
        self.output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        mp_ctx = rank_start_context()
        config_bytes = msgspec.msgpack.encode(config)
        self.joining = [mp_ctx.Event() for _ in range(1, size)]
        self.processes = [
            mp_ctx.Process(
                target=_rank_process,
                args=(
                    dict(os.environ),
                    config_bytes,
                    rank,
                    init_method,
                    self.endpoints[rank - 1],
                    output_endpoint,
                    self.joining[rank - 1],
                ),
                name=f"zllm-executor-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        try:
            for proc in self.processes:
                proc.start()
        except BaseException:
            self.close()  # the ones started, the sockets, the directory
            raise

    def wait_joining(self) -> None:
        """Until every rank is about to join the process group. Rank 0 (the caller's process)
        waits here, not at the rendezvous, which would wait COLLECTIVE_TIMEOUT_S (10 minutes)
        for a rank that died starting: a blocked rendezvous cannot be interrupted. A rank
        that dies later, loading the model, fails rank 0's first collective at once (its
        connection closes)."""
        for event in self.joining:
            while not event.wait(0.5):
                self.check_alive()

    def check_alive(self) -> None:
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"executor rank processes died: {', '.join(dead)}")

    def forward(self, step: SchedulerOutput) -> None:
        self.check_alive()
        self.fanout.forward(self.encoder.encode(step))

    def receive_output(self, timeout_s: float | None = None) -> ModelRunnerOutput | None:
        """The answering rank's next output (pipeline stages), waiting up to `timeout_s`
        (None: until it comes); None if it has not come by then."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if self.outputs.poll(max(0, int(wait_s * 1000))):
                return self.output_decoder.decode(self.outputs.recv())
            self.check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        """Stop the other ranks and leave the process group (a later engine may form one)."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        self.fanout.close()
        self.outputs.close(linger=0)
        for proc in self.processes:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        deadline = time.monotonic() + 10
        for proc in self.processes:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        import shutil

        shutil.rmtree(self.run_dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _private_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="zllm-tp-")
