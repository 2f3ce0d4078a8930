"""The HTTP app in the test process, over real engine processes that the tests of one process
share (tests/conftest.py's `engine_pool`, one per xdist worker).

`zllm serve` is a supervisor, the engine processes (tokenizers, core, executor ranks,
detokenizers) and a frontend process that serves `build_app` with uvicorn. A test whose
subject is the HTTP app needs no supervisor or frontend process of its own: `EnginePool.serve`
runs the same app (frontend/app.py's `build_app` over an EngineClient) with uvicorn on a
loopback port in a thread of this process, over engine processes started by `AsyncLLM` (the
supervisor in a thread, as `zllm run-batch` runs them), and returns an `AppServer` that tests
drive over HTTP like a `servers.Server`.

The engine processes are what a start costs (the executor's torch, the model), and they read
nothing of the frontend's options (api keys, served names, limits, CORS, parsers, tracing):
apps whose `zllm serve` arguments differ only in those (FRONTEND_ONLY) share one engine. A
shared engine comes to its next app as a fresh server would, as far as a test can ask it:
nothing running and an empty prefix cache (reset). Its counters (/metrics' engine series:
tokens, requests per tenant, cache hits) keep counting across apps, so a test that reads
their absolute values takes an engine of its own (`shared=False`). Tests of the processes
(signals, deaths and restarts, the supervisor, TLS) start a real `zllm serve`
(servers.start_server). At most `keep` engines stay alive; the least recently used is
stopped first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import servers
from servers import HttpMethods, alive, free_port, process_title

# ServeConfig fields only the frontend reads (frontend/, uvicorn): not part of an engine's key.
FRONTEND_ONLY = frozenset(
    {
        "host",
        "port",
        "api_keys",
        "served_model_names",
        "drain_timeout",
        "enable_log_requests",
        "max_waiting_requests",
        "max_request_body_bytes",
        "timeout_keep_alive",
        "protect_metrics",
        "metrics_api_keys",
        "allowed_origins",
        "trust_request_chat_template",
        "default_chat_template_kwargs",
        "thinking_signature_key_file",
        "tool_call_parser",
        "reasoning_parser",
        "prefix_cache_isolation",
        "tenant_max_concurrency",
        "tenant_max_requests_per_second",
        "otlp_traces_endpoint",
    }
)
START_TIMEOUT_S = servers.START_TIMEOUT_S


@dataclass
class AppServer(HttpMethods):
    """An app served in this process: what tests ask a `servers.Server` over HTTP (url, port,
    get, post, healthy, headers); no processes, log or run directory of its own."""

    url: str
    port: int
    serve_config: object  # its ServeConfig
    log: Path  # the app's log lines (the frontend's, in this process)
    engine_log: Path  # its engine processes' (shared with the engine's other apps)
    engine_started: int  # where the engine's start ends in its log
    engine_since: int  # where this app's part of the engine log begins
    supervisor: object  # its engine's (zllm/runtime/supervisor.py, in a thread here)
    headers: dict[str, str] = field(default_factory=dict)
    verify: bool = True

    def children(self) -> dict[str, int]:
        """Its engine's live processes by title without the `zllm: ` prefix, as
        `Server.children` names them: {"core": pid, "executor": pid, ...}."""
        pids = [child.proc.pid for child in self.supervisor.children]
        return {process_title(pid)[6:]: pid for pid in pids if alive(pid)}

    def config(self) -> dict:
        """The config as `Server.config` reads it (the run directory's config.json)."""
        return msgspec.to_builtins(self.serve_config)

    def log_text(self) -> str:
        """What `zllm serve` would have logged: the engine processes' lines of their start and
        since the app started (not those of the engine's earlier apps), then the app's."""
        with open(self.engine_log, "rb") as f:
            engine = f.read()
        if self.engine_since > self.engine_started:
            engine = engine[: self.engine_started] + engine[self.engine_since :]
        return engine.decode(errors="replace") + self.log.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]


@dataclass(eq=False)
class _Engine:
    key: bytes
    config: object  # the ServeConfig it started with
    llm: object  # zllm.AsyncLLM
    tokenizer: object
    log: Path
    started: int  # the log's size once it started
    apps: int = 0  # served now (an engine serving an app is never stopped for another)

    def alive(self) -> bool:
        supervisor = self.llm._supervisor
        children_alive = all(c.proc.poll() is None for c in supervisor.children)
        return children_alive and not supervisor.stopping and self.llm.client.health()[0]


class EnginePool:
    def __init__(self, log_dir: Path, keep: int = 2) -> None:
        self.log_dir = log_dir
        self.keep = keep
        self._engines: OrderedDict[bytes, _Engine] = OrderedDict()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-pool")
        self._thread.daemon = True
        self._thread.start()
        self.starts = 0  # engines started
        # Every engine's asyncio tasks (its client's receiver), which an app leaves running.
        self._engine_tasks: set[asyncio.Task] = set()

    def _run(self, coro, timeout: float = START_TIMEOUT_S):
        """`coro` on the pool's loop; TimeoutError naming it after `timeout` seconds (it is
        cancelled then)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{coro.__qualname__} took over {timeout:.0f} s") from None

    @contextlib.contextmanager
    def serve(
        self, model: str, log: Path, *extra: str, api_key: str | None = None, shared: bool = True
    ) -> Iterator[AppServer]:
        """The app `zllm serve model *extra` would serve (with start_server's defaults: a
        64 MB KV pool, loopback), over a pooled engine, for the `with` block; the app's log
        lines (zllm's loggers in this process, at INFO) go to `log`. `shared=False`: over an
        engine of its own, stopped after the block (a test that reads the engine's counters
        from zero)."""
        if servers.in_e2e_test is False:
            raise RuntimeError("a test that serves the app must be marked pytest.mark.e2e")
        port = free_port()
        argv = ["serve", model, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--kv-cache-memory-bytes", "64M"]
        if api_key is not None:
            argv += ["--api-key", api_key]
        with _logging_to(log):  # (what the config and the start log, as zllm serve's would)
            config = _serve_config(argv + list(extra))
            engine = self._engine_for(config) if shared else self._start_engine(config, b"")
            if config is not engine.config:  # its own addresses are unused: the engine's serve
                _remove_run_dir(config)
            app_config = msgspec.structs.replace(
                engine.config, **{name: getattr(config, name) for name in FRONTEND_ONLY}
            )
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            url = f"http://127.0.0.1:{port}"
            since = engine.log.stat().st_size
            engine.apps += 1
            uvicorn_server, task = self._run(_start_app(engine, app_config, self._engine_tasks))
            try:
                supervisor = engine.llm._supervisor
                yield AppServer(url, port, app_config, log, engine.log, engine.started, since,
                                supervisor, headers)  # fmt: skip
            finally:
                engine.apps -= 1
                self._run(_stop_app(uvicorn_server, task), timeout=60)
                if not shared:
                    self._shutdown(engine)

    def _engine_for(self, config) -> _Engine:
        key = engine_key(config)
        engine = self._engines.pop(key, None)
        if engine is not None:
            try:  # (made fresh only when idle: an app it serves now keeps what it has done)
                fresh = engine.apps or self._run(_made_fresh(engine), 120)
            except BaseException:
                self._shutdown(engine)
                raise
            if not (engine.alive() and fresh):
                self._shutdown(engine)
                engine = None
        if engine is None:
            idle = [k for k, e in self._engines.items() if e.apps == 0]  # least recent first
            for old in idle[: max(0, len(self._engines) - self.keep + 1)]:
                self._shutdown(self._engines.pop(old))
            engine = self._start_engine(config, key)
        self._engines[key] = engine  # (the most recently used last)
        return engine

    def _start_engine(self, config, key: bytes) -> _Engine:
        from zllm.text.tokenizer import load_tokenizer

        self.starts += 1
        log = self.log_dir / f"engine-{self.starts}.log"
        # The engine's processes write their log lines to this file, as `zllm serve`'s to
        # its log: they inherit stdout and stderr when they start.
        with open(log, "ab") as out, _stdout_and_stderr_to(out.fileno()):
            llm, tasks = self._run(_start_llm(config))
        self._engine_tasks |= tasks
        tokenizer = load_tokenizer(config.engine.tokenizer_path, config.chat_template)
        return _Engine(key, config, llm, tokenizer, log, log.stat().st_size)

    def _shutdown(self, engine: _Engine) -> None:
        self._run(engine.llm.shutdown(), timeout=90)
        self._engine_tasks -= {t for t in self._engine_tasks if t.done()}  # (in place)

    def close(self) -> None:
        while self._engines:
            self._shutdown(self._engines.popitem()[1])
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def engine_key(config) -> bytes:
    """What an engine is started with: the config without the frontend's fields and the
    addresses (each config gets its own)."""
    fields = msgspec.to_builtins(config)
    for name in FRONTEND_ONLY | {"endpoints"}:
        fields.pop(name, None)
    return msgspec.json.encode(fields, order="sorted")


def _serve_config(argv: list[str]):
    from zllm.cli import build_parser, serve_config_from_args

    return serve_config_from_args(build_parser().parse_args(argv))


def _remove_run_dir(config) -> None:
    if config.endpoints.ipc_dir:
        shutil.rmtree(config.endpoints.ipc_dir, ignore_errors=True)


async def _start_llm(config):
    """The engine (AsyncLLM), and the asyncio tasks it made."""
    from zllm.async_llm import AsyncLLM

    # One torch thread per engine process, as start_server gives its servers.
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    before = asyncio.all_tasks()
    try:
        llm = await AsyncLLM.start_with(config)
        return llm, asyncio.all_tasks() - before
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous


async def _made_fresh(engine: _Engine) -> bool:
    """Nothing left running from the last app, and an empty prefix cache."""
    client = engine.llm.client
    deadline = time.monotonic() + 30
    while client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_in_flight:
        return False
    await client.reset_prefix_cache()
    return True


async def _start_app(engine: _Engine, config, engine_tasks: set[asyncio.Task]):
    import uvicorn

    from zllm.frontend.app import build_app

    run_dir = engine.llm._supervisor.run_dir
    app = build_app(config, engine.llm.client, engine.tokenizer, run_dir)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        log_config=None,  # (its loggers are left to _logging_to, not set to stderr)
        timeout_keep_alive=config.timeout_keep_alive,
    )
    server = uvicorn.Server(uv_config)
    # What _stop_app leaves running: what ran before, and every engine's (the pool's set: an
    # engine started while the app is served included).
    server.tasks_before, server.engine_tasks = asyncio.all_tasks(), engine_tasks
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # its error
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)
    return server, task


async def _stop_app(server, task) -> None:
    server.should_exit = True
    await task
    # The app's own tasks (the dashboard's timeline samples "for the life of the process"):
    # a frontend process ends with them; here they end with the app.
    own = asyncio.all_tasks() - server.tasks_before - server.engine_tasks
    own.discard(asyncio.current_task())
    for app_task in own:
        app_task.cancel()
    await asyncio.gather(*own, return_exceptions=True)
    tracer = server.config.app.state.server.tracer
    if tracer is not None:  # the spans still batched
        await asyncio.to_thread(tracer.shutdown)


@contextlib.contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """zllm's loggers at INFO, and uvicorn's (at the frontend's level: warnings, an error in
    the app), into `path`, as a frontend process logs to `zllm serve`'s output, for the
    block."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    zllm, uvicorn = logging.getLogger("zllm"), logging.getLogger("uvicorn")
    level = zllm.level
    zllm.setLevel(logging.INFO)
    for logger in (zllm, uvicorn):
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in (zllm, uvicorn):
            logger.removeHandler(handler)
        zllm.setLevel(level)
        handler.close()


@contextlib.contextmanager
def _stdout_and_stderr_to(fd: int) -> Iterator[None]:
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for s in saved:
            os.close(s)
