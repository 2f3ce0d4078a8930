"""The executor process: holds the model and the KV cache, runs each step the core sends.

    core ──SchedulerOutput──► [PULL executor_in]  ModelRunner  [PUSH executor_out] ──► core

It binds both sockets, so the core (restarted with it) simply reconnects. The time between
answering one step and receiving the next is the executor's idle time, reported with each
step: the design exists to keep it near zero.

With --tensor-parallel-size N the supervisor starts N of these, ranks 0..N-1 (the second
argument), titled `zllm: executor <rank>` (`zllm: executor <rank> dp<engine>` for engine
<engine> of --data-parallel-size; the third argument). Rank 0 is the one above and also forwards each
step to the others (executor/ranks.py), which run it on their part of the model and answer
no one.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from zllm.messaging import decode_or_drop
from zllm.parallel_config import TP_INIT_ENV
from zllm.procutil import index_arg, report_ready, start_process
from zllm.protocol import ProcessRole, SchedulerOutput

logger = logging.getLogger("zllm.executor")


def main() -> None:
    rank = index_arg()
    config = start_process(
        ProcessRole.EXECUTOR,
        index_of=lambda c: rank if c.engine.tensor_parallel_size > 1 else None,
    )
    # torch: only in this process
    from zllm.executor.model_runner import ModelRunner
    from zllm.executor.parallel import init_tensor_parallel
    from zllm.executor.ranks import StepFanout, follow_steps, run_step

    size = config.engine.tensor_parallel_size
    endpoints = config.engine_endpoints
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    if rank > 0:
        inbox.connect(endpoints.executor_ranks[rank - 1])
    else:
        inbox.bind(endpoints.executor_in)
        outbox = ctx.socket(zmq.PUSH)
        outbox.bind(endpoints.executor_out)
        fanout = StepFanout(ctx, endpoints.executor_ranks)
    tp = init_tensor_parallel(
        rank,
        size,
        os.environ.get(TP_INIT_ENV, ""),
        config.engine.device,
        engines=config.data_parallel_size,
        engine=config.engine_index,
    )
    runner = ModelRunner(config.engine, tp)
    report_ready(config, ProcessRole.EXECUTOR, rank, num_blocks=runner.num_blocks)
    if rank > 0:
        follow_steps(runner, inbox)
        return

    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    idle_since = time.perf_counter()
    while True:
        frame = inbox.recv(copy=False)
        start = time.perf_counter()  # the step's time includes decoding its message
        fanout.forward(frame)  # the other ranks start the step with this one
        scheduler_output = decode_or_drop(decoder, frame.buffer, logger)
        if scheduler_output is None:
            continue
        output = run_step(runner, scheduler_output)
        output.idle_time_s = 0.0 if scheduler_output.after_no_work else start - idle_since
        output.exec_time_s = time.perf_counter() - start
        outbox.send(encoder.encode(output))
        idle_since = time.perf_counter()


if __name__ == "__main__":
    main()
