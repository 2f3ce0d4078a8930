"""The executor process: holds the model and the KV cache, runs each step the core sends.

    core ──SchedulerOutput──► [PULL executor_in]  ModelRunner  [PUSH executor_out] ──► core

It binds both sockets, so the core (restarted with it) simply reconnects. The time between
answering one step and receiving the next is the executor's idle time, reported with each
step: the design exists to keep it near zero.

With --tensor-parallel-size and --pipeline-parallel-size the supervisor starts one of these
per rank (the second argument), titled `zllm: executor <rank>` (`zllm: executor <rank>
dp<engine>` for engine <engine> of --data-parallel-size; the third argument). Rank 0 binds
executor_in and forwards each step to the others (executor/ranks/processes.py); every rank runs it on
its part of the model, and the answering rank (rank 0, or with pipeline stages the last
stage's first rank) binds executor_out and sends the output.

With --distributed-executor-backend ray there is one executor process, which places the
ranks as Ray actors and relays between them and the core (executor/ranks/ray_actors.py); a KV
consumer's receivers then run in the actors.

A prefill/decode disaggregation consumer (--kv-transfer-config kv_consumer) also runs a
receiver thread here, in every rank of every stage (rank r = stage x tensor-parallel size +
tensor-parallel rank, of data-parallel engine e, at kv_port + e x ranks + r): its part of the
KV blocks from the producer's rank r into its buffer, news of them to its core
(executor/kv/transfer.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import zmq

from zllm.config.parallel import TP_INIT_ENV
from zllm.config.serve import ServeConfig
from zllm.protocol import ProcessRole
from zllm.runtime.procutil import index_arg, report_ready, start_process

if TYPE_CHECKING:  # (imported in main: torch only once the process knows it runs a model)
    from zllm.executor.model_runner import ModelRunner

logger = logging.getLogger("zllm.executor")


def main() -> None:
    rank = index_arg()
    config = start_process(
        ProcessRole.EXECUTOR,
        index_of=lambda c: rank if c.engine.executor_processes > 1 else None,
    )
    if config.engine.distributed_executor_backend == "ray":
        from zllm.executor.ranks.ray_actors import run_ray_driver

        run_ray_driver(config)  # the ranks are Ray actors; this process relays and watches
        return
    # torch: only in this process
    from zllm.executor.model_runner import ModelRunner
    from zllm.executor.ranks.processes import StepFanout, join_ranks, serve_steps

    engine = config.engine
    endpoints = config.engine_endpoints
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    fanout = None
    if rank > 0:
        inbox.connect(endpoints.executor_ranks[rank - 1])
    else:
        inbox.bind(endpoints.executor_in)
        fanout = StepFanout(ctx, endpoints.executor_ranks)
    parallel = join_ranks(
        engine,
        rank,
        os.environ.get(TP_INIT_ENV, ""),
        engines=config.data_parallel_size,
        engine=config.engine_index,
    )
    outbox = None
    if parallel.answers:
        outbox = ctx.socket(zmq.PUSH)
        outbox.bind(endpoints.executor_out)
    runner = ModelRunner(engine, parallel)
    if engine.kv_transfer is not None and engine.kv_transfer.consumes:
        start_kv_receiver(config, runner, parallel.rank)
    report_ready(config, ProcessRole.EXECUTOR, rank, num_blocks=runner.num_blocks)
    serve_steps(runner, inbox, fanout, outbox)


def start_kv_receiver(config: ServeConfig, runner: ModelRunner, rank: int) -> None:
    """Prefill/decode disaggregation, a consumer: blocks from prefill instances, into the
    buffer. Each executor rank (every stage's tensor-parallel ranks: `rank` is stage x
    tensor-parallel size + tensor-parallel rank) of each data-parallel engine receives its
    part of the blocks on its own port."""
    from zllm.executor.kv.transfer import KVReceiver, transfer_layout

    engine = config.engine
    assert engine.kv_transfer is not None
    assert runner.kv_tiers is not None and runner.kv_tiers.remote is not None
    KVReceiver(
        engine.kv_transfer,
        runner.kv_tiers.remote,
        transfer_layout(engine, rank),
        config.engine_endpoints.core_in,
        rank,
        engine=config.engine_index,
        ranks=engine.world_size,
    )


if __name__ == "__main__":
    main()
