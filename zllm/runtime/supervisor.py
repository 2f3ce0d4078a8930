"""`zllm serve`: start every process, wire the sockets, watch the children, shut down cleanly.

Start order: the executor first (it loads the model and sizes the KV pool, which fixes the
number of blocks and so the longest context), then the core. The tokenizer and detokenizer
workers and the frontend start beside the executor, so their imports overlap its load, but
are held (`wait_for_config`) until the config they read, the pool's size in it, is written.
Each child reports ready on `supervisor_in`. With
--data-parallel-size N there are N engines (a core and its executor ranks each), started
side by side; each engine's processes read a config file of their own (its KV pool size).

Watching (every 0.1 s, in one loop that never blocks on a restart):
- A dead child (a SIGKILL or an OOM kill shows up the same way): tokenizer, detokenizer and
  frontend workers are restarted alone; a dead frontend's requests are aborted in the cores
  (`ClientGone`), since nobody will read them. The core and the executor are one engine:
  the frontend is told the engine is dead (it fails every request in flight on it with a
  503; /health turns 503 when no engine is left), its processes are restarted
  (`--on-engine-failure restart`; the other engines serve on) or the supervisor exits
  non-zero (`exit`) for an orchestrator to restart it.
- A hung core: its heartbeat (every 0.5 s, from a thread of its own) reaches the supervisor
  too; none for `--engine-hang-timeout` seconds counts as a dead core.
- A restart spawns the new process and goes back to watching; the child's ready report is
  handled when it arrives, so a second death during a restart is seen at once.
Children get SIGKILL from the kernel if the supervisor itself dies, so none is orphaned.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from zllm.config.parallel import TP_INIT_ENV
from zllm.config.serve import ServeConfig, decode_config, encode_config
from zllm.protocol import (
    ClientGone,
    EngineLifecycle,
    EngineState,
    EngineStats,
    ProcessEvent,
    ProcessReady,
    ProcessRole,
    SupervisorInput,
)
from zllm.runtime.messaging import receive_nowait, send_nowait
from zllm.runtime.procutil import HELD_ENV, free_ports
from zllm.runtime.ray_head import RAY_ADDRESS_ENV, RayHead, needs_own_head

logger = logging.getLogger("zllm.runtime.supervisor")

_MODULES = {
    ProcessRole.EXECUTOR: "zllm.executor.main",
    ProcessRole.CORE: "zllm.core.main",
    ProcessRole.TOKENIZER: "zllm.tokenizer_proc.main",
    ProcessRole.DETOKENIZER: "zllm.detokenizer_proc.main",
    ProcessRole.FRONTEND: "zllm.frontend.main",
}
READY_TIMEOUT_S = 600.0  # loading a large model on a slow disk can take minutes
WATCH_INTERVAL_S = 0.1


class StartupError(RuntimeError):
    pass


@dataclass(eq=False)
class Child:
    role: ProcessRole
    index: int
    proc: subprocess.Popen
    started_at: float  # monotonic
    ready: bool = False
    engine: int = 0  # a core's or executor rank's engine

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}" + (f" of engine {self.engine}" if self.engine else "")


@dataclass(eq=False)
class Engine:
    """One engine (a data-parallel replica): a core and its executor ranks."""

    index: int
    config: ServeConfig  # its own copy: its KV pool size
    config_path: str
    state: EngineState = EngineState.STARTING
    last_heartbeat: float = 0.0  # monotonic


class Supervisor:
    def __init__(self, config: ServeConfig, with_frontend: bool = True) -> None:
        """`with_frontend=False`: the caller's own EngineClient plays the frontend's part."""
        self.config = config
        self.with_frontend = with_frontend
        self.children: list[Child] = []
        self.run_dir = config.endpoints.ipc_dir or _private_dir()
        self.config_path = os.path.join(self.run_dir, "config.json")
        ctx = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(config.endpoints.supervisor_in)
        self.to_frontend = ctx.socket(zmq.PUSH)
        self.to_frontend.connect(config.endpoints.frontend_in)
        self.to_cores = []
        for endpoints in config.endpoints.engines:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(endpoints.core_in)
            self.to_cores.append(sock)
        self.decoder = msgspec.msgpack.Decoder(SupervisorInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.engines = [
            Engine(e, engine_config(config, e), os.path.join(self.run_dir, f"engine-{e}.json"))
            for e in range(config.data_parallel_size)
        ]
        self.ray_head: RayHead | None = None  # the engines' shared Ray cluster (ray_head.py)
        self.started = False  # start() finished: from now on a failure restarts, not raises
        self.stopping = False
        self.exit_code = 0

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every child and wait until all are ready; StartupError if one fails."""
        backend = self.config.engine.distributed_executor_backend
        if needs_own_head(backend, self.config.data_parallel_size):
            self.ray_head = RayHead(self.run_dir)
            try:
                self.ray_head.wait_ready()
            except RuntimeError as e:
                raise StartupError(str(e)) from e
        for engine in self.engines:
            self._start_engine(engine)
        held = [self._spawn(role, i, held=True) for role, i in self._shared_workers()]
        self._watch_until(lambda: all(e.state == EngineState.READY for e in self.engines))
        self._write_config()
        for child in held:
            _release(child)
        self._watch_until(self._all_ready)
        self._brief_frontend()
        self.started = True

    def _shared_workers(self) -> list[tuple[ProcessRole, int]]:
        """The processes every engine shares (role, index)."""
        workers = [(ProcessRole.TOKENIZER, i) for i in range(self.config.tokenizer_workers)]
        workers += [(ProcessRole.DETOKENIZER, i) for i in range(self.config.detokenizer_workers)]
        if self.with_frontend:
            workers.append((ProcessRole.FRONTEND, 0))
        return workers

    def _all_ready(self) -> bool:
        return all(c.ready for c in self.children)

    def _watch_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.stopping:
                raise StartupError("interrupted while starting")
            self._watch_once()

    def _brief_frontend(self) -> None:
        """Tell the frontend every child is up and which engines are ready."""
        for child in self.children:
            self._tell_frontend(_process_event(child, True))
        for engine in self.engines:
            if engine.state == EngineState.READY:
                self._tell_frontend(EngineLifecycle(EngineState.READY, engine=engine.index))

    def _start_engine(self, engine: Engine) -> None:
        """The executor first (every rank of it: tensor-parallel ranks times pipeline
        stages); the core follows once the ranks report their KV pool."""
        engine.state = EngineState.STARTING
        _write(engine.config_path, engine.config)
        # A fresh rendezvous port each start: a killed rank 0's may still be in use.
        env = {**os.environ, TP_INIT_ENV: f"tcp://127.0.0.1:{free_ports(1)[0]}"}
        if self.ray_head is not None:  # every engine's Ray driver joins the one cluster
            env[RAY_ADDRESS_ENV] = self.ray_head.address
        for rank in range(self.config.engine.executor_processes):
            self._spawn(ProcessRole.EXECUTOR, rank, env, engine)

    def _write_config(self) -> None:
        """The shared processes' config: the longest context every engine can hold."""
        cache, scheduler = self.config.engine.cache, self.config.engine.scheduler
        cache.num_blocks = min(e.config.engine.cache.num_blocks or 0 for e in self.engines)
        scheduler.max_model_len = min(e.config.engine.scheduler.max_model_len for e in self.engines)
        _write(self.config_path, self.config)

    def _spawn(
        self,
        role: ProcessRole,
        index: int,
        env: dict[str, str] | None = None,
        engine: Engine | None = None,
        held: bool = False,
    ) -> Child:
        """`held`: the child waits for `_release` before it reads its config."""
        cmd = [sys.executable, "-m", _MODULES[role], self.config_path, str(index)]
        if engine is not None:  # its own config, and its index (for the title)
            cmd[3:] = [engine.config_path, str(index), str(engine.index)]
        if held:
            env = {**(env or os.environ), HELD_ENV: "1"}
        stdin = subprocess.PIPE if held else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdin=stdin, env=env)
        child = Child(role, index, proc, time.monotonic(), engine=engine.index if engine else 0)
        self.children.append(child)
        logger.debug("started %s (pid %d)", child.name, proc.pid)
        return child

    # ---- watch ---------------------------------------------------------------------------
    def run(self) -> int:
        """Watch the children until a signal asks us to stop; returns the exit code."""
        while not self.stopping:
            self._watch_once()
        self.shutdown()
        return self.exit_code

    def _watch_once(self) -> None:
        """Read what children sent for up to WATCH_INTERVAL_S, then look for the dead, the
        late and the hung."""
        for msg in receive_nowait(self.inbox, self.decoder, logger, WATCH_INTERVAL_S):
            if isinstance(msg, ProcessReady):
                self._on_ready(msg)
            elif isinstance(msg, EngineStats) and msg.status.engine_index < len(self.engines):
                self.engines[msg.status.engine_index].last_heartbeat = time.monotonic()
        if self.ray_head is not None and self.ray_head.dead():
            # Every engine's actors went with it: nothing left to restart on.
            logger.error("the engines' Ray head node exited; shutting down")
            self.exit_code, self.stopping, self.ray_head = 1, True, None
            return
        now = time.monotonic()
        for child in list(self.children):
            if self.stopping:
                return
            if child not in self.children:
                continue  # killed by a restart handled earlier in this pass
            if child.proc.poll() is not None:
                self._on_death(child, f"died with code {child.proc.returncode}")
            elif not child.ready and now - child.started_at > READY_TIMEOUT_S:
                self._on_death(child, f"did not report ready within {READY_TIMEOUT_S:.0f} s")
        for engine in self.engines:
            hang = now - engine.last_heartbeat
            if engine.state == EngineState.READY and hang > self.config.engine_hang_timeout:
                core = next(
                    c
                    for c in self.children
                    if c.role == ProcessRole.CORE and c.engine == engine.index
                )
                self._on_death(core, f"sent no heartbeat for {hang:.1f} s (hung)")

    def _on_ready(self, msg: ProcessReady) -> None:
        child = next(
            (
                c
                for c in self.children
                if (c.role, c.index, c.proc.pid, c.engine)
                == (msg.role, msg.index, msg.pid, msg.engine)
            ),
            None,
        )
        if child is None or child.ready:
            return  # a child killed meanwhile, or a duplicate report
        child.ready = True
        logger.debug("%s (pid %d) is ready", child.name, msg.pid)
        engine = self.engines[child.engine]
        if child.role == ProcessRole.EXECUTOR:
            ranks = [
                c
                for c in self.children
                if c.role == ProcessRole.EXECUTOR and c.engine == engine.index
            ]
            if all(c.ready for c in ranks):  # every rank sized the same pool
                self._executor_ready(engine, msg.num_blocks)
        elif child.role == ProcessRole.CORE:
            self._engine_ready(engine)
        elif self.started:  # a restarted worker
            if child.role == ProcessRole.FRONTEND:
                self._brief_frontend()  # a new frontend knows nothing yet
            else:
                self._tell_frontend(_process_event(child, True))

    def _executor_ready(self, engine: Engine, num_blocks: int) -> None:
        config = engine.config.engine
        # Its executor sized the pool from the configured budget each time it starts: the
        # same number, unless a GPU's free memory changed.
        config.cache.num_blocks = num_blocks
        # The pool bounds the context: one request alone must always fit.
        capacity = num_blocks * config.cache.block_size
        config.scheduler.max_model_len = min(self.config.engine.scheduler.max_model_len, capacity)
        _write(engine.config_path, engine.config)
        self._spawn(ProcessRole.CORE, 0, engine=engine)

    def _engine_ready(self, engine: Engine) -> None:
        engine.state = EngineState.READY
        engine.last_heartbeat = time.monotonic()
        if not self.started:
            return
        for child in self.children:
            if child.role.is_engine and child.engine == engine.index:
                self._tell_frontend(_process_event(child, True))
        self._tell_frontend(EngineLifecycle(EngineState.READY, engine=engine.index))
        logger.info(
            "engine restarted" if len(self.engines) == 1 else f"engine {engine.index} restarted"
        )

    def _on_death(self, child: Child, what: str) -> None:
        logger.error("%s (pid %d) %s", child.name, child.proc.pid, what)
        self._kill(child)
        if not self.started:
            raise StartupError(f"{child.name} {what} while starting")
        if not child.ready:
            # It died before it ever worked: restarting it again would likely loop.
            logger.error("could not restart %s; shutting down", child.name)
            self.exit_code = 1
            self.stopping = True
        elif child.role.is_engine:
            self._restart_engine(self.engines[child.engine], f"{child.name} {what}")
        else:
            if child.role == ProcessRole.FRONTEND:
                # Its requests are still running in the cores: nobody will read them.
                for sock in self.to_cores:
                    send_nowait(sock, self.encoder, ClientGone(child.proc.pid), logger)
            self._spawn(child.role, child.index)

    def _restart_engine(self, engine: Engine, reason: str) -> None:
        engine.state = EngineState.DEAD
        self._tell_frontend(EngineLifecycle(EngineState.DEAD, reason, engine.index))
        for other in [c for c in self.children if c.role.is_engine and c.engine == engine.index]:
            self._kill(other)
        if self.config.on_engine_failure == "exit":
            logger.error("engine failed (%s); exiting as --on-engine-failure exit asks", reason)
            self.exit_code = 1
            self.stopping = True
            return
        logger.warning("engine failed (%s); restarting it", reason)
        self._start_engine(engine)

    def _kill(self, child: Child) -> None:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
        if child in self.children:
            self.children.remove(child)
        self._tell_frontend(_process_event(child, False))

    def _tell_frontend(self, msg: ProcessEvent | EngineLifecycle) -> None:
        """(Or the embedding application's EngineClient, which binds the same socket.)"""
        try:
            self.to_frontend.send(self.encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no frontend right now; a new one is briefed when it is ready

    # ---- stop ----------------------------------------------------------------------------
    def request_stop(self, signum=None, frame=None) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """Frontend first (it drains in-flight requests), then everything else."""
        frontends = [c for c in self.children if c.role == ProcessRole.FRONTEND]
        for child in frontends:
            _signal(child, signal.SIGTERM)
        for child in frontends:
            _wait(child, self.config.drain_timeout + 5.0)
        for child in self.children:
            _signal(child, signal.SIGTERM)
        for child in self.children:
            _wait(child, 5.0)
        self.children.clear()
        if self.ray_head is not None:  # after the drivers: their actors go first
            self.ray_head.stop()
        for sock in (self.inbox, self.to_frontend, *self.to_cores):
            sock.close(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        logger.info("all processes stopped")


def serve(config: ServeConfig) -> int:
    supervisor = Supervisor(config)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    try:
        supervisor.start()
    except StartupError as e:
        logger.error("startup failed: %s", e)
        supervisor.shutdown()
        return 1
    except BaseException:
        supervisor.shutdown()
        raise
    names = ", ".join(config.model_names)
    print(f"zllm: sockets and config in {supervisor.run_dir}", flush=True)
    print(f"zllm: serving {names} on {config.scheme}://{config.host}:{config.port}", flush=True)
    return supervisor.run()


def _process_event(child: Child, alive: bool) -> ProcessEvent:
    return ProcessEvent(child.role, child.index, alive, child.proc.pid, child.engine)


def engine_config(config: ServeConfig, engine: int) -> ServeConfig:
    """Data-parallel engine `engine`'s copy of the config. With several engines each keeps
    its disk tier in a subdirectory of --kv-offload-dir (engine-<i>): a tier is one engine's
    index of block files, its byte bound and its LRU order, and holds a lock on its
    directory; sharing one would need the engines to agree on every store and eviction,
    while the router already sends a prefix to the engine that holds it."""
    own = msgspec.structs.replace(_copy(config), engine_index=engine)
    offload = own.engine.kv_offload
    if config.data_parallel_size > 1 and offload is not None and offload.disk_dir is not None:
        offload.disk_dir = os.path.join(offload.disk_dir, f"engine-{engine}")
    return own


def _copy(config: ServeConfig) -> ServeConfig:
    return decode_config(encode_config(config))


def _write(path: str, config: ServeConfig) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(encode_config(config))
    os.replace(tmp, path)


def _private_dir() -> str:
    import tempfile

    d = tempfile.mkdtemp(prefix="zllm-")
    os.chmod(d, 0o700)
    return d


def _release(child: Child) -> None:
    """Tell a held child its config is written (a dead one's death is seen by the watch)."""
    try:
        child.proc.stdin.write(b"go\n")
        child.proc.stdin.close()
    except OSError:
        pass


def _signal(child: Child, sig: int) -> None:
    if child.proc.poll() is None:
        child.proc.send_signal(sig)


def _wait(child: Child, timeout: float) -> None:
    try:
        child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s did not stop in %.0f s; killing it", child.name, timeout)
        child.proc.kill()
        child.proc.wait()
