"""`zllm serve`: start every process, wire the sockets, watch the children, shut down cleanly.

Start order: the executor first (it loads the model and sizes the KV pool, which fixes the
number of blocks and so the longest context), then the core, the tokenizer and detokenizer
workers, and last the frontend. Each child reports ready on `supervisor_in`.

When a child dies (the supervisor polls them every 0.1 s; a SIGKILL or an OOM kill shows up
the same way): tokenizer, detokenizer and frontend workers are restarted alone. The core and
the executor are one engine: the frontend is told the engine is dead (it fails every request
in flight with a 503 and /health turns 503), both are restarted (`--on-engine-failure
restart`) or the supervisor exits non-zero (`exit`) for an orchestrator to restart it.
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
from dataclasses import dataclass

import msgspec
import zmq

from zllm.protocol import EngineState, ProcessEvent, ProcessReady
from zllm.serve_config import ServeConfig, encode_config

logger = logging.getLogger("zllm.supervisor")

_MODULES = {
    "executor": "zllm.executor.main",
    "core": "zllm.core.main",
    "tokenizer": "zllm.tokenizer_proc.main",
    "detokenizer": "zllm.detokenizer_proc.main",
    "frontend": "zllm.frontend.main",
}
READY_TIMEOUT_S = 600.0  # loading a large model on a slow disk can take minutes


class StartupError(RuntimeError):
    pass


@dataclass(eq=False)
class Child:
    role: str
    index: int
    proc: subprocess.Popen

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
        self.decoder = msgspec.msgpack.Decoder(ProcessReady)
        self.encoder = msgspec.msgpack.Encoder()
        self.stopping = False
        self.exit_code = 0

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> None:
        self._write_config()
        self._start_engine()
        workers = [("tokenizer", i) for i in range(self.config.tokenizer_workers)]
        workers += [("detokenizer", i) for i in range(self.config.detokenizer_workers)]
        self._wait_ready([self._spawn(role, i) for role, i in workers])
        if self.with_frontend:
            self._wait_ready([self._spawn("frontend", 0)])
        self._brief_frontend()

    def _brief_frontend(self) -> None:
        """Tell the frontend every child is up and the engine is ready."""
        for child in self.children:
            self._tell_frontend(ProcessEvent(child.role, child.index, True, child.proc.pid))
        self._tell_frontend(EngineState("ready"))

    def _start_engine(self) -> None:
        executor = self._spawn("executor", 0)
        (ready,) = self._wait_ready([executor])
        engine = self.config.engine
        if engine.cache.num_blocks != ready.num_blocks:
            engine.cache.num_blocks = ready.num_blocks
            # The pool bounds the context: one request alone must always fit.
            capacity = ready.num_blocks * engine.cache.block_size
            engine.scheduler.max_model_len = min(engine.scheduler.max_model_len, capacity)
            self._write_config()
        self._wait_ready([self._spawn("core", 0)])

    def _write_config(self) -> None:
        tmp = self.config_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(encode_config(self.config))
        os.replace(tmp, self.config_path)

    def _spawn(self, role: str, index: int) -> Child:
        cmd = [sys.executable, "-m", _MODULES[role], self.config_path, str(index)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        child = Child(role, index, proc)
        self.children.append(child)
        logger.debug("started %s (pid %d)", child.name, proc.pid)
        return child

    def _wait_ready(self, children: list[Child]) -> list[ProcessReady]:
        """Wait until each child reports ready; StartupError if one dies or times out."""
        pending = {(c.role, c.index): c for c in children}
        ready: dict[tuple[str, int], ProcessReady] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending:
            if self.stopping:
                raise StartupError("interrupted while starting")
            for child in pending.values():
                if child.proc.poll() is not None:
                    raise StartupError(
                        f"{child.name} exited with code {child.proc.returncode} while starting"
                    )
            if time.monotonic() > deadline:
                raise StartupError(f"timed out waiting for {', '.join(pending)} to start")
            if self.inbox.poll(100):
                data = self.inbox.recv()
                try:
                    msg = self.decoder.decode(data)
                except msgspec.DecodeError as e:
                    logger.error("dropping a malformed message (%d bytes): %s", len(data), e)
                    continue
                key = (msg.role, msg.index)
                if key in pending:
                    del pending[key]
                    ready[key] = msg
        return [ready[(c.role, c.index)] for c in children]

    # ---- watch ---------------------------------------------------------------------------
    def run(self) -> int:
        """Watch the children until a signal asks us to stop; returns the exit code."""
        while not self.stopping:
            for child in list(self.children):
                # (a restart may have replaced children already in this snapshot)
                if child in self.children and child.proc.poll() is not None and not self.stopping:
                    self._on_death(child)
            time.sleep(0.1)
        self.shutdown()
        return self.exit_code

    def _on_death(self, child: Child) -> None:
        code = child.proc.returncode
        logger.error("%s (pid %d) died with code %s", child.name, child.proc.pid, code)
        self.children.remove(child)
        self._tell_frontend(ProcessEvent(child.role, child.index, False, child.proc.pid))
        try:
            if child.role in ("core", "executor"):
                self._restart_engine(f"{child.name} died (exit code {code})")
            else:
                new = self._spawn(child.role, child.index)
                self._wait_ready([new])
                if new.role == "frontend":
                    self._brief_frontend()  # a new frontend knows nothing yet
                else:
                    self._tell_frontend(ProcessEvent(new.role, new.index, True, new.proc.pid))
        except StartupError as e:
            logger.error("could not restart %s: %s; shutting down", child.name, e)
            self.exit_code = 1
            self.stopping = True

    def _restart_engine(self, reason: str) -> None:
        self._tell_frontend(EngineState("dead", reason))
        for other in [c for c in self.children if c.role in ("core", "executor")]:
            self._kill(other)
        if self.config.on_engine_failure == "exit":
            logger.error("engine failed (%s); exiting as --on-engine-failure exit asks", reason)
            self.exit_code = 1
            self.stopping = True
            return
        logger.warning("engine failed (%s); restarting it", reason)
        self._start_engine()
        for child in self.children:
            if child.role in ("core", "executor"):
                self._tell_frontend(ProcessEvent(child.role, child.index, True, child.proc.pid))
        self._tell_frontend(EngineState("ready"))
        logger.info("engine restarted")

    def _kill(self, child: Child) -> None:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
        if child in self.children:
            self.children.remove(child)
        self._tell_frontend(ProcessEvent(child.role, child.index, False, child.proc.pid))

    def _tell_frontend(self, msg) -> None:
        try:
            self.to_frontend.send(self.encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    # ---- stop ----------------------------------------------------------------------------
    def request_stop(self, signum=None, frame=None) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """Frontend first (it drains in-flight requests), then everything else."""
        frontends = [c for c in self.children if c.role == "frontend"]
        for child in frontends:
            _signal(child, signal.SIGTERM)
        for child in frontends:
            _wait(child, self.config.drain_timeout + 5.0)
        for child in self.children:
            _signal(child, signal.SIGTERM)
        for child in self.children:
            _wait(child, 5.0)
        self.children.clear()
        self.inbox.close(linger=0)
        self.to_frontend.close(linger=0)
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
