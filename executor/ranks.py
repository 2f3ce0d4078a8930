"""Tensor-parallel ranks as processes: rank 0 forwards every step to the others.

    core ──SchedulerOutput──► rank 0 ──the same frame──► rank 1 .. N-1   (ZeroMQ PUSH/PULL)
                               │                          │
                               └──── all-reduce / all-gather (torch.distributed) ────┘
    rank 0 ──ModelRunnerOutput──► core                     (the others' outputs are dropped)

Rank 0 passes the message on before decoding it, so the ranks start a step together; every
rank then runs the same `ModelRunner.execute_model` on its part of the model, meeting the
others in each layer's collectives. PUSH/PULL (not PUB/SUB) so a message sent before a rank
has connected waits for it instead of being lost.

In `zllm serve` the supervisor starts every rank as an executor process (executor/main.py).
The offline `LLM` runs rank 0 in its own process and starts the others here
(`start_ranks`, `RankProcesses`).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Sequence

import msgspec
import zmq

from zllm.config import EngineConfig
from zllm.messaging import decode_or_drop
from zllm.protocol import SchedulerOutput

logger = logging.getLogger(__name__)


class StepFanout:
    """Rank 0's sockets to the other ranks: each step's frame, as received."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str]) -> None:
        self.sockets = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.bind(endpoint)
            self.sockets.append(sock)

    def forward(self, frame: zmq.Frame | bytes) -> None:
        for sock in self.sockets:
            sock.send(frame, copy=False)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def run_step(runner, step: SchedulerOutput):
    """One step as every rank runs it: waking first or sleeping after when the core says."""
    if step.wake_up:
        runner.wake_up()
    output = runner.execute_model(step)
    if step.sleep:
        runner.sleep()
    return output


def follow_steps(runner, inbox: zmq.Socket) -> None:
    """A rank from 1: run every step rank 0 forwards, forever; the output stays here."""
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    while True:
        frame = inbox.recv(copy=False)
        step = decode_or_drop(decoder, frame.buffer, logger)
        if step is not None:
            run_step(runner, step)


def _rank_process(config_bytes: bytes, rank: int, init_method: str, endpoint: str) -> None:
    """Entry of an offline rank process (spawned, so it imports torch afresh)."""
    from zllm.procutil import die_with_parent, title_process

    die_with_parent()
    title_process(f"zllm: executor {rank}")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    inbox = zmq.Context.instance().socket(zmq.PULL)
    inbox.connect(endpoint)
    from zllm.executor.model_runner import ModelRunner
    from zllm.executor.parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, config.tensor_parallel_size, init_method, config.device)
    follow_steps(ModelRunner(config, tp), inbox)


class RankProcesses:
    """The offline engine's ranks 1..N-1 (rank 0 is the caller's ModelRunner): started
    here, fed through `fanout`, killed with `close` or when this process dies."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        size = config.tensor_parallel_size
        self.closed = False
        self.run_dir = run_dir = _private_dir()
        self.encoder = msgspec.msgpack.Encoder()
        self.endpoints = [f"ipc://{run_dir}/executor_rank_{r}" for r in range(1, size)]
        self.fanout = StepFanout(zmq.Context.instance(), self.endpoints)
        ctx = multiprocessing.get_context("spawn")
        config_bytes = msgspec.msgpack.encode(config)
        self.processes = [
            ctx.Process(
                target=_rank_process,
                args=(config_bytes, rank, init_method, self.endpoints[rank - 1]),
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

    def forward(self, step: SchedulerOutput) -> None:
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank processes died: {', '.join(dead)}")
        self.fanout.forward(self.encoder.encode(step))

    def close(self) -> None:
        """Stop the other ranks and leave the process group (a later engine may form one)."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        self.fanout.close()
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


def start_ranks(config: EngineConfig):
    """The offline engine's ModelRunner (rank 0) and, with tensor_parallel_size > 1, the
    processes of ranks 1..N-1 it forwards each step to (None on one rank)."""
    from zllm.executor.model_runner import ModelRunner
    from zllm.executor.parallel import init_tensor_parallel
    from zllm.serve_config import free_ports

    if config.tensor_parallel_size == 1:
        return ModelRunner(config), None
    init_method = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    ranks = RankProcesses(config, init_method)
    try:
        tp = init_tensor_parallel(0, config.tensor_parallel_size, init_method, config.device)
        return ModelRunner(config, tp), ranks
    except BaseException:
        ranks.close()
        raise


def _private_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="zllm-tp-")
