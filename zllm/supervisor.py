"""`zllm serve`: start every process, wire the sockets, watch the children, shut down cleanly.

Start order: the executor first (it loads the model and sizes the KV pool, which fixes the
number of blocks and so the longest context), then the core, the tokenizer and detokenizer
workers, and last the frontend. Each child reports ready on `supervisor_in`.

Watching (every 0.1 s, in one loop that never blocks on a restart):
- A dead child (a SIGKILL or an OOM kill shows up the same way): tokenizer, detokenizer and
  frontend workers are restarted alone; a dead frontend's requests are aborted in the core
  (`ClientGone`), since nobody will read them. The core and the executor are one engine:
  the frontend is told the engine is dead (it fails every request in flight with a 503 and
  /health turns 503), both are restarted (`--on-engine-failure restart`) or the supervisor
  exits non-zero (`exit`) for an orchestrator to restart it.
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

from zllm.messaging import receive_nowait, send_nowait
from zllm.parallel_config import TP_INIT_ENV
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
from zllm.serve_config import ServeConfig, encode_config, free_ports

logger = logging.getLogger("zllm.supervisor")

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

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"


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
        self.to_core = ctx.socket(zmq.PUSH)
        self.to_core.connect(config.endpoints.core_in)
        self.decoder = msgspec.msgpack.Decoder(SupervisorInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.engine_state = EngineState.STARTING
        self.last_heartbeat = time.monotonic()
        self.started = False  # start() finished: from now on a failure restarts, not raises
        self.stopping = False
        self.exit_code = 0

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every child and wait until all are ready; StartupError if one fails."""
        self._write_config()
        self._start_engine()
        self._watch_until(lambda: self.engine_state == EngineState.READY)
        for role, count in (
            (ProcessRole.TOKENIZER, self.config.tokenizer_workers),
            (ProcessRole.DETOKENIZER, self.config.detokenizer_workers),
        ):
            for i in range(count):
                self._spawn(role, i)
        self._watch_until(self._all_ready)
        if self.with_frontend:
            self._spawn(ProcessRole.FRONTEND, 0)
            self._watch_until(self._all_ready)
        self._brief_frontend()
        self.started = True

    def _all_ready(self) -> bool:
        return all(c.ready for c in self.children)

    def _watch_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.stopping:
                raise StartupError("interrupted while starting")
            self._watch_once()

    def _brief_frontend(self) -> None:
        """Tell the frontend every child is up and the engine is ready."""
        for child in self.children:
            self._tell_frontend(ProcessEvent(child.role, child.index, True, child.proc.pid))
        self._tell_frontend(EngineLifecycle(EngineState.READY))

    def _start_engine(self) -> None:
        """The executor first (every tensor-parallel rank of it); the core follows once the
        ranks report their KV pool."""
        self.engine_state = EngineState.STARTING
        # A fresh rendezvous port each start: a killed rank 0's may still be in use.
        env = {**os.environ, TP_INIT_ENV: f"tcp://127.0.0.1:{free_ports(1)[0]}"}
        for rank in range(self.config.engine.tensor_parallel_size):
            self._spawn(ProcessRole.EXECUTOR, rank, env)

    def _write_config(self) -> None:
        tmp = self.config_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(encode_config(self.config))
        os.replace(tmp, self.config_path)

    def _spawn(self, role: ProcessRole, index: int, env: dict[str, str] | None = None) -> Child:
        cmd = [sys.executable, "-m", _MODULES[role], self.config_path, str(index)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        child = Child(role, index, proc, time.monotonic())
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
            elif isinstance(msg, EngineStats):
                self.last_heartbeat = time.monotonic()
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
        hang = now - self.last_heartbeat
        if self.engine_state == EngineState.READY and hang > self.config.engine_hang_timeout:
            core = next(c for c in self.children if c.role == ProcessRole.CORE)
            self._on_death(core, f"sent no heartbeat for {hang:.1f} s (hung)")

    def _on_ready(self, msg: ProcessReady) -> None:
        child = next(
            (
                c
                for c in self.children
                if (c.role, c.index, c.proc.pid) == (msg.role, msg.index, msg.pid)
            ),
            None,
        )
        if child is None or child.ready:
            return  # a child killed meanwhile, or a duplicate report
        child.ready = True
        logger.debug("%s (pid %d) is ready", child.name, msg.pid)
        if child.role == ProcessRole.EXECUTOR:
            ranks = [c for c in self.children if c.role == ProcessRole.EXECUTOR]
            if all(c.ready for c in ranks):  # every rank sized the same pool
                self._executor_ready(msg.num_blocks)
        elif child.role == ProcessRole.CORE:
            self._engine_ready()
        elif self.started:  # a restarted worker
            if child.role == ProcessRole.FRONTEND:
                self._brief_frontend()  # a new frontend knows nothing yet
            else:
                self._tell_frontend(ProcessEvent(child.role, child.index, True, msg.pid))

    def _executor_ready(self, num_blocks: int) -> None:
        engine = self.config.engine
        if engine.cache.num_blocks != num_blocks:
            engine.cache.num_blocks = num_blocks
            # The pool bounds the context: one request alone must always fit.
            capacity = num_blocks * engine.cache.block_size
            engine.scheduler.max_model_len = min(engine.scheduler.max_model_len, capacity)
            self._write_config()
        self._spawn(ProcessRole.CORE, 0)

    def _engine_ready(self) -> None:
        self.engine_state = EngineState.READY
        self.last_heartbeat = time.monotonic()
        if not self.started:
            return
        for child in self.children:
            if child.role.is_engine:
                self._tell_frontend(ProcessEvent(child.role, child.index, True, child.proc.pid))
        self._tell_frontend(EngineLifecycle(EngineState.READY))
        logger.info("engine restarted")

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
            self._restart_engine(f"{child.name} {what}")
        else:
            if child.role == ProcessRole.FRONTEND:
                # Its requests are still running in the core: nobody will read them.
                send_nowait(self.to_core, self.encoder, ClientGone(child.proc.pid), logger)
            self._spawn(child.role, child.index)

    def _restart_engine(self, reason: str) -> None:
        self.engine_state = EngineState.DEAD
        self._tell_frontend(EngineLifecycle(EngineState.DEAD, reason))
        for other in [c for c in self.children if c.role.is_engine]:
            self._kill(other)
        if self.config.on_engine_failure == "exit":
            logger.error("engine failed (%s); exiting as --on-engine-failure exit asks", reason)
            self.exit_code = 1
            self.stopping = True
            return
        logger.warning("engine failed (%s); restarting it", reason)
        self._start_engine()

    def _kill(self, child: Child) -> None:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
        if child in self.children:
            self.children.remove(child)
        self._tell_frontend(ProcessEvent(child.role, child.index, False, child.proc.pid))

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
        for sock in (self.inbox, self.to_frontend, self.to_core):
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
    print(f"zllm: serving {names} on http://{config.host}:{config.port}", flush=True)
    return supervisor.run()


def _private_dir() -> str:
    import tempfile

    d = tempfile.mkdtemp(prefix="zllm-")
    os.chmod(d, 0o700)
    return d


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
