"""The executor process: holds the model and the KV cache, runs each step the core sends.

    core ──SchedulerOutput──► [PULL executor_in]  ModelRunner  [PUSH executor_out] ──► core

It binds both sockets, so the core (restarted with it) simply reconnects. The time between
answering one step and receiving the next is the executor's idle time, reported with each
step: the design exists to keep it near zero.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from zllm.messaging import decode_or_drop
from zllm.procutil import report_ready, start_process
from zllm.protocol import ProcessRole, SchedulerOutput

logger = logging.getLogger("zllm.executor")


def main() -> None:
    config = start_process(ProcessRole.EXECUTOR)
    from zllm.executor.model_runner import ModelRunner  # torch: only in this process

    runner = ModelRunner(config.engine)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(config.endpoints.executor_in)
    outbox = ctx.socket(zmq.PUSH)
    outbox.bind(config.endpoints.executor_out)
    report_ready(config, ProcessRole.EXECUTOR, 0, num_blocks=runner.num_blocks)

    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    idle_since = time.perf_counter()
    while True:
        frame = inbox.recv(copy=False)
        start = time.perf_counter()  # the step's time includes decoding its message
        scheduler_output = decode_or_drop(decoder, frame.buffer, logger)
        if scheduler_output is None:
            continue
        if scheduler_output.wake_up:
            runner.wake_up()
        output = runner.execute_model(scheduler_output)
        if scheduler_output.sleep:
            runner.sleep()
        output.idle_time_s = 0.0 if scheduler_output.after_no_work else start - idle_since
        output.exec_time_s = time.perf_counter() - start
        outbox.send(encoder.encode(output))
        idle_since = time.perf_counter()


if __name__ == "__main__":
    main()
