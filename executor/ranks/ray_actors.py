"""`--distributed-executor-backend ray`: the executor's ranks as Ray actors, placed by a
placement group on the nodes of a Ray cluster (`ray start --head` / `ray start --address`).

    core ──executor_in──► executor process (the driver) ──tcp──► rank 0 actor ──tcp──► ranks 1..N-1
      ▲                       │ zmq.proxy relays both ways          (the fan-out of executor/ranks/processes.py)
      └──executor_out─────────┘◄──tcp── the answering rank's actor

The supervisor starts one executor process, as for one rank. It joins the cluster
(`RAY_ADDRESS`, else a cluster already running on this host, else a local one), reserves one
bundle per rank (a GPU, or on CPU its share of the cores: `rank_bundle`) in a placement group with
`--ray-placement-strategy` (PACK, STRICT_PACK, SPREAD, STRICT_SPREAD), and starts an actor per
rank in its bundle. Each actor runs what an executor rank process runs
(`serve_steps` over a ModelRunner, torch.distributed between the ranks with rank 0's node as
the rendezvous), with its sockets on TCP so ranks can sit on other nodes. The driver relays
the core's steps to rank 0 and the answering rank's outputs back (two `zmq.proxy` threads),
reports the KV pool to the supervisor, then watches the actors: when any dies (its node lost,
killed), the driver exits, which is an executor death as with processes: the supervisor
fails what was in flight and starts the engine again, with a new placement group.

With --data-parallel-size N every engine has its own driver, placement group (named
`zllm-engine-<i>-<driver pid>`) and actors, all on one cluster (zllm/runtime/ray_head.py: the
supervisor names it in RAY_ADDRESS); an engine's driver owns only its own, so its restart
leaves the other engines' actors serving.

Prefill/decode disaggregation: a producer rank's KVSender runs in its actor (the ModelRunner
holds it); a consumer rank's KVReceiver too, beside the KV pool whose buffer it fills, bound
at kv_port + its tensor-parallel rank on the actor's node, and its news (KVBlocksReceived)
go to the core through the driver's relay, since the core's input may be ipc:// on the
driver's host.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import msgspec
import zmq

from zllm.config.engine import EngineConfig
from zllm.config.serve import ServeConfig
from zllm.protocol import ProcessRole
from zllm.runtime.procutil import report_ready

logger = logging.getLogger("zllm.executor")

# Seconds to wait for the placement group's bundles (a cluster short of nodes).
PLACEMENT_TIMEOUT_S = 300.0


class RankActor:
    """One executor rank in a Ray worker process (made a Ray actor class in `_actor_class`,
    so this module imports without Ray)."""

    def __init__(self, config_bytes: bytes, rank: int, cpus: int) -> None:
        """`cpus`: the CPUs its bundle reserved, its torch pool's threads on CPU."""
        from zllm.runtime.procutil import title_process

        # Titled and logging as a rank process would (Ray sends its output to the driver's).
        title_process(f"zllm: executor {rank} (ray)")
        self.config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        self.rank = rank
        self.cpus = cpus
        self.ctx = zmq.Context.instance()
        self.fanout = None  # rank 0's sockets to the others (open_fanout)

    def where(self) -> tuple[str, str, int]:
        """(this actor's node id, its IP address, its process id)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def open_rendezvous(self) -> str:
        """Rank 0: a free port on its node for torch.distributed's rendezvous."""
        from zllm.runtime.procutil import free_ports

        ip = self.where()[1]
        return f"tcp://{ip}:{free_ports(1, ip)[0]}"

    def open_fanout(self, num_others: int) -> list[str]:
        """Rank 0: PUSH sockets the other ranks connect to, bound on its node."""
        from zllm.executor.ranks.processes import StepFanout

        self.fanout, addresses = StepFanout.on_random_ports(self.ctx, self.where()[1], num_others)
        return addresses

    def start(
        self,
        init_method: str,
        inbox: str,
        outbox: str | None,
        kv_news: str | None = None,
        engine_index: int = 0,
    ) -> int:
        """Join the ranks and load this rank's part of the model, with its sockets: steps
        from `inbox`, outputs (the answering rank) to `outbox`; a KV consumer's receiver
        (of data-parallel engine `engine_index`) tells the core what it received through
        `kv_news` (the driver's relay). Returns the KV pool's blocks (the same on every
        rank)."""
        from zllm.executor.model_runner import ModelRunner
        from zllm.executor.ranks.processes import join_ranks

        config = self.config
        self._check_model()
        parallel = join_ranks(config, self.rank, init_method)
        if not config.device.startswith("cuda"):
            import torch

            torch.set_num_threads(self.cpus)  # the bundle's cores
        self.runner = ModelRunner(config, parallel)  # a KV producer's sender starts in it
        if kv_news is not None:
            self._receive_kv(parallel.rank, kv_news, engine_index)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(inbox)
        self.outbox = None
        if outbox is not None:
            self.outbox = self.ctx.socket(zmq.PUSH)
            self.outbox.connect(outbox)
        return self.runner.num_blocks

    def _check_model(self) -> None:
        if not os.path.exists(self.config.model_path):
            node, ip, _ = self.where()
            raise FileNotFoundError(
                f"executor rank {self.rank} on Ray node {node} ({ip}) has no "
                f"{self.config.model_path}: every node needs the model at the same path "
                "(shared storage, or `zllm download` with the same ZLLM_CACHE before `ray start`)"
            )

    def _receive_kv(self, rank: int, kv_news: str, engine_index: int) -> None:
        """A KV consumer's receiver, here where this rank's buffer is (its KV pool's tier):
        it binds kv_port + engine_index x ranks + rank (stage x tensor-parallel size +
        tensor-parallel rank) on this actor's node and sends its
        news to the driver's relay (the core's own socket may be ipc:// on the driver's
        host)."""
        from zllm.executor.kv.transfer import KVReceiver, transfer_layout

        transfer, tiers = self.config.kv_transfer, self.runner.kv_tiers
        assert transfer is not None and tiers is not None and tiers.remote is not None
        layout = transfer_layout(self.config, rank)
        self.kv_receiver = KVReceiver(
            transfer,
            tiers.remote,
            layout,
            kv_news,
            rank,
            engine=engine_index,
            ranks=self.config.world_size,
        )

    def serve(self) -> None:
        """Run every step that comes, forever (an actor call that returns only by failing).
        In the actor's main thread, where the model's OpenMP pool is fast: the same steps
        run 1.5x slower from a thread Python started (measured, in and out of Ray)."""
        from zllm.executor.ranks.processes import serve_steps

        serve_steps(self.runner, self.inbox, self.fanout, self.outbox)


def rank_bundle(config: EngineConfig, engines: int = 1) -> dict[str, float]:
    """What one rank reserves: a GPU; on CPU its share of a node's cores, taken as this
    host's cores over every engine's ranks (nodes alike), at least one. Ray gives an actor
    as many threads (OMP_NUM_THREADS) as CPUs, so the share is the rank's torch pool, as a
    rank process's on one host."""
    if config.device.startswith("cuda"):
        return {"GPU": 1.0}
    share = len(os.sched_getaffinity(0)) // (config.world_size * engines)
    return {"CPU": float(max(1, share))}


def _actor_class(bundle: dict[str, float]) -> Any:
    import ray

    return ray.remote(num_gpus=bundle.get("GPU", 0), num_cpus=bundle.get("CPU", 0))(RankActor)


def run_ray_driver(config: ServeConfig) -> None:
    """The executor process under the Ray backend: never returns while the ranks serve."""
    import ray

    _join_cluster()
    # The supervisor stops this process with SIGTERM: exit quietly (Ray's own handler logs a
    # stack), and the actors, owned by this driver, go with it.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    engine = config.engine
    actors = _place_actors(config)
    num_blocks = _start_ranks(config, actors)
    report_ready(config, ProcessRole.EXECUTOR, 0, num_blocks=num_blocks)
    logger.info(
        "%d executor rank(s) ready as Ray actors (%s)",
        engine.world_size,
        engine.ray_placement_strategy,
    )
    serving = [actor.serve.remote() for actor in actors]
    done, _ = ray.wait(serving, num_returns=1)
    try:
        ray.get(done[0])
    except Exception as e:  # an actor died (its node lost) or stopped serving
        logger.error("a Ray executor rank is gone: %s", e)
    os._exit(3)  # an executor death: the supervisor restarts the engine


def _join_cluster() -> None:
    """`RAY_ADDRESS`, else a cluster already running on this host, else a local one."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address or "auto", log_to_driver=True, logging_level=logging.WARNING)
    except ConnectionError:
        if address:  # the cluster named is not there: say so (the supervisor stops)
            raise
        logger.info("no Ray cluster on this host: starting a local one for this engine")
        ray.init(log_to_driver=True, logging_level=logging.WARNING)


def _place_actors(config: ServeConfig) -> list[Any]:
    """One actor per rank, each in its bundle of this engine's own placement group (named
    by engine and driver, so data-parallel engines never take each other's bundles; it and
    the actors are this driver's, and go with it alone)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    engine = config.engine
    world = engine.world_size
    bundle = rank_bundle(engine, config.data_parallel_size)
    strategy = engine.ray_placement_strategy
    name = f"zllm-engine-{config.engine_index}-{os.getpid()}"
    group = placement_group([dict(bundle) for _ in range(world)], strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise RuntimeError(
            f"Ray could not place {world} bundles of {bundle} ({strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s: the cluster has {ray.cluster_resources()}"
        )
    actor_class = _actor_class(bundle)
    config_bytes = msgspec.msgpack.encode(engine)
    actors = [
        actor_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            ),
            # Ray starts worker processes at niceness 15, below every other process of the
            # server; a rank is the server's hot loop (measured: 1.5x slower steps on a busy
            # 2-core host). Ray's job supervisor starts its own workers this way too.
            runtime_env={"env_vars": {"RAY_worker_niceness": "0"}},
        ).remote(config_bytes, rank, max(1, int(bundle.get("CPU", 1))))
        for rank in range(world)
    ]
    places = ray.get([a.where.remote() for a in actors])
    for rank, (node, ip, pid) in enumerate(places):
        logger.info(
            "executor rank %d: Ray actor on node %s (%s), pid %d, group %s",
            rank,
            node,
            ip,
            pid,
            name,
        )
    return actors


def _start_ranks(config: ServeConfig, actors: list[Any]) -> int:
    """Join the actors into the engine's ranks, with the driver's relays between them and
    the core (on an address every node can reach); returns the KV pool's blocks."""
    import ray

    engine = config.engine
    ctx = zmq.Context.instance()
    driver_ip = ray.util.get_node_ip_address()
    relays = _Relays(ctx, config, driver_ip)
    rank0 = actors[0]
    init_method = ray.get(rank0.open_rendezvous.remote())
    fanout = ray.get(rank0.open_fanout.remote(len(actors) - 1))
    answering = (engine.pipeline_parallel_size - 1) * engine.tensor_parallel_size
    starts = [
        actor.start.remote(
            init_method,
            relays.to_rank0 if rank == 0 else fanout[rank - 1],
            relays.answers if rank == answering else None,
            relays.kv_news,
            config.engine_index,
        )
        for rank, actor in enumerate(actors)
    ]
    # The first rank to fail fails the start (the others may wait in the rendezvous for it).
    pending, num_blocks = list(starts), 0
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        num_blocks = ray.get(done[0])
    relays.start()
    return num_blocks


class _Relays:
    """The driver's sockets between the core's (which may be ipc://, on this host only) and
    the actors' (TCP on the driver's IP): steps to rank 0, the answering rank's outputs
    back, and a KV consumer's receivers' news (KVBlocksReceived) to the core's input."""

    def __init__(self, ctx: zmq.Context, config: ServeConfig, driver_ip: str) -> None:
        endpoints = config.engine_endpoints
        self.pairs: list[tuple[str, zmq.Socket, zmq.Socket]] = []
        from_core = ctx.socket(zmq.PULL)
        from_core.bind(endpoints.executor_in)
        to_core = ctx.socket(zmq.PUSH)
        to_core.bind(endpoints.executor_out)
        self.to_rank0 = self._pair(ctx, "steps", from_core, zmq.PUSH, driver_ip, outward=True)
        self.answers = self._pair(ctx, "outputs", to_core, zmq.PULL, driver_ip, outward=False)
        self.kv_news: str | None = None
        transfer = config.engine.kv_transfer
        if transfer is not None and transfer.consumes:
            to_core_in = ctx.socket(zmq.PUSH)
            to_core_in.connect(endpoints.core_in)
            self.kv_news = self._pair(ctx, "kv-news", to_core_in, zmq.PULL, driver_ip, False)

    def _pair(
        self, ctx: zmq.Context, name: str, core_side: zmq.Socket, kind: int, ip: str, outward: bool
    ) -> str:
        """A TCP socket for the actors, relayed to or from `core_side`; its address."""
        sock = ctx.socket(kind)
        address = f"tcp://{ip}:{sock.bind_to_random_port(f'tcp://{ip}')}"
        self.pairs.append((name, core_side, sock) if outward else (name, sock, core_side))
        return address

    def start(self) -> None:
        """The relays run from now on (once every rank has started)."""
        for name, src, dst in self.pairs:
            threading.Thread(target=zmq.proxy, args=(src, dst), name=name, daemon=True).start()
