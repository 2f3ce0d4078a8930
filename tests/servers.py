"""The one harness for tests that run a real `zllm serve` (supervisor and every child process)
on the tiny random model, and talk to it over loopback HTTP only.

`start_server` waits for /health; the supervisor's output (stdout and stderr, every child's
log lines included) goes to a log file, from which the run directory (sockets and
config.json) is read. `stop_server` is SIGTERM, as an operator stops it; `Server.kill` is
SIGKILL, for a test that has already stopped it or must not wait. Children are found
through /proc, by their process titles (`zllm: core`, `zllm: tokenizer 0`, ...). `http` is
a lean HTTP/1.1 client on raw asyncio streams: for bursts of hundreds of requests it
measures the server, where a full client library on the same 2 cores would mostly measure
itself. SSE streams are split into lines by `sse_lines`, never by httpx's `iter_lines`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 120.0


class HttpMethods:
    """Requests to a server at `self.url` with its `headers` (an API key) and TLS `verify`:
    a `Server` here, an in-process app (tests/engine_pool.py) the same way."""

    url: str
    headers: dict[str, str]
    verify: ssl.SSLContext | bool

    def get(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        kw.setdefault("verify", self.verify)
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        kw.setdefault("verify", self.verify)
        timeout = kw.pop("timeout", 60)
        if isinstance(body, (dict, list)):
            return httpx.post(self.url + path, json=body, timeout=timeout, **kw)
        return httpx.post(self.url + path, content=body, timeout=timeout, **kw)  # bytes, chunks

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Server(HttpMethods):
    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    run_dir: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    # An https server's client context (its CA trusted, a client certificate if asked for).
    verify: ssl.SSLContext | bool = True

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def children(self) -> dict[str, int]:
        """Live children by title without the `zllm: ` prefix: {"core": pid, ...}."""
        result = {}
        for pid in children_of(self.proc.pid):
            title = process_title(pid)
            if title.startswith("zllm: ") and alive(pid):
                result[title[6:]] = pid
        return result

    def config(self) -> dict:
        with open(os.path.join(self.run_dir, "config.json")) as f:
            return json.load(f)

    def kill(self) -> None:
        """SIGKILL the supervisor (its children get SIGKILL from the kernel) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can be handed again, to any process that connects or binds to 0 (Ray
    starts dozens), before the server binds it; ports below the range are only taken by
    an explicit bind."""
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (every try taken: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Set by tests/conftest.py while a test sets up and runs: whether it is marked e2e (None
# outside those phases, or outside pytest).
in_e2e_test: bool | None = None


def start_server(
    model_dir: str,
    log: Path,
    *extra: str,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """`zllm serve` on loopback with a small KV pool; returns once /health answers 200 and
    the run directory is known. `extra` are more `zllm serve` options (later ones win), e.g.
    worker counts or --served-model-name; with `api_key`, get/post send it. `tls`: the
    server serves HTTPS (its --ssl-* options in `extra`), reached with this client context.
    `env`: variables over the server's environment (OMP_NUM_THREADS=1 unless given)."""
    if in_e2e_test is False:
        raise RuntimeError("a test that starts `zllm serve` must be marked pytest.mark.e2e")
    port = free_port()
    cmd = [sys.executable, "-m", "zllm.cli", "serve", model_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", "64M"]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    cmd += list(extra)
    # One torch thread: the tiny model needs no more, and on a shared 2-core machine several
    # OpenMP threads spin against each other (steps 10-100x slower under load).
    server_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    scheme = "http" if tls is None else "https"
    server = Server(f"{scheme}://127.0.0.1:{port}", port, proc, log, headers=headers)
    if tls is not None:
        server.verify = tls
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (server.healthy() and "sockets and config in" in server.log_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"zllm serve exited with {proc.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(
                f"zllm serve not healthy in {START_TIMEOUT_S} s:\n{server.log_tail()}"
            )
        time.sleep(0.2)
    server.run_dir = re.search(r"sockets and config in (\S+)", server.log_text()).group(1)
    return server


def stop_server(server: Server, timeout: float = 30) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


# ---- processes -----------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ---- HTTP ----------------------------------------------------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float

    def json(self):
        return json.loads(self.body)


async def http(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> RawResponse:
    """One request on its own connection (Connection: close), read to the end."""
    start = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        head += [f"{k}: {v}" for k, v in all_headers.items()]
        if method == "POST":
            head.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    raw_head, _, payload = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    response_headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        response_headers[name.strip().lower()] = value.strip()
    if response_headers.get("transfer-encoding") == "chunked":
        payload = _dechunk(payload)
    return RawResponse(status, response_headers, payload, time.monotonic() - start)


def _dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2


class StaleConnectionRetry(httpx.AsyncHTTPTransport):
    """httpx's transport, plus what browsers and the openai client do: a request whose
    kept-alive connection fails before any response came back is sent once more, on a new
    connection. The server closes an idle connection after its keep-alive timeout (uvicorn's
    5 s); one the client takes from its pool just then dies under the request (ReadError, or
    "Server disconnected"), a race every HTTP/1.1 client has. A request that went out on a
    fresh connection is never sent again: a drop there is the server's fault. (Use it for
    requests that may run twice.) `retries` counts the requests sent again."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.retries = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        events: list[str] = []

        async def trace(name: str, info: dict) -> None:
            events.append(name)

        request.extensions = {**request.extensions, "trace": trace}
        try:
            # (Returns once the response's head is read: a failure here came before it.)
            return await super().handle_async_request(request)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            if any(name.startswith("connection.") for name in events):
                raise  # it opened a connection of its own: not a pooled one gone stale
        self.retries += 1
        request.extensions = {k: v for k, v in request.extensions.items() if k != "trace"}
        return await super().handle_async_request(request)


def engine_idle(server: Server) -> bool:
    """Nothing running or waiting, and no KV block held (from /metrics)."""
    text = server.get("/metrics").text
    return (
        metric(text, "vllm:num_requests_running") == 0
        and metric(text, "vllm:num_requests_waiting") == 0
        and metric(text, "vllm:kv_cache_usage_perc") == 0
    )


def metric(text: str, name: str, label: str = "") -> float:
    """The value of the first series of `name` in a /metrics text whose labels hold `label`
    (e.g. 'tier="remote"'; "": any)."""
    match = re.search(rf"^{re.escape(name)}{{[^}}]*{label}[^}}]*}} (\S+)$", text, re.M)
    assert match, f"{name}{{{label}}} missing from /metrics"
    return float(match.group(1))


def sse_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of an SSE stream from its text chunks (httpx's `iter_text()`), as they come.

    Not httpx's `iter_lines()`: like str.splitlines it also breaks lines at U+0085, U+2028
    and other separators, which sampled text holds, unescaped, inside the JSON of an event.
    SSE ends lines with LF or CR LF only (the server sends LF)."""
    pending = ""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split("\n")
        yield from (line.removesuffix("\r") for line in lines)
    if pending:
        yield pending


async def asse_lines(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    """sse_lines for `aiter_text()`."""
    pending = ""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


def sse_events(lines) -> list[dict]:
    """The JSON payloads of an SSE stream; `[DONE]` must come last."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, "an event after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[6:]))
    assert done, "the stream did not end with [DONE]"
    return events


def error_of(r: httpx.Response | RawResponse, status: int) -> dict:
    """The OpenAI-shaped error of a response with this status."""
    if isinstance(r, httpx.Response):
        assert r.status_code == status, r.text[:1000]
    else:
        assert r.status == status, r.body[:1000]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


async def one_request(client: httpx.AsyncClient, url: str, i: int, stream: bool) -> str:
    """One /v1/completions request of 400 tokens (streamed or not) under fault injection:
    'ok', or how it failed: 'status 503', 'error event', 'dropped' (the connection)."""
    max_tokens = 400
    body = {"prompt": f"Paged attention {i}", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                assert error_of(r, r.status_code)
                return f"status {r.status_code}"
            assert r.json()["usage"]["completion_tokens"] == max_tokens
            return "ok"
        body["stream"] = True
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                assert error_of(r, r.status_code)
                return f"status {r.status_code}"
            lines = [line async for line in asse_lines(r.aiter_text())]
        events = sse_events(lines)
        if "error" in events[-1]:
            assert events[-1]["error"]["message"]
            return "error event"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        return "ok"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
        return "dropped"


def fail_under_load(server: Server, fail: Callable[[], object], timeout: float = 90) -> list[str]:
    """Eight 400-token completions in flight (every other one streamed), `fail()` called half
    a second after they start (in a thread: it may block); each one's outcome (`one_request`:
    'ok', 'status 503', 'error event', 'dropped')."""

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=timeout) as c:
            tasks = [
                asyncio.create_task(one_request(c, server.url, i, stream=i % 2 == 0))
                for i in range(8)
            ]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(fail)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout)

    return asyncio.run(scenario())


def kill_rank_under_load(server: Server, victim_name: str, restarted: Iterable[str]) -> int:
    """SIGKILL the child titled `victim_name` (an executor rank) while eight requests run: an
    executor death. Every in-flight request ends well or with a 503 / error event (at least
    one of them fails), /health comes back, and each process in `restarted` has a new pid.
    Returns the victim's pid."""
    old = server.children()
    victim = old[victim_name]
    outcomes = fail_under_load(server, lambda: os.kill(victim, signal.SIGKILL))
    assert set(outcomes) <= {"ok", "status 503", "error event"}, outcomes
    assert outcomes.count("ok") < len(outcomes), outcomes
    assert wait_until(server.healthy, 60)
    new = server.children()
    for name in restarted:
        assert new[name] != old[name], f"{name} was not restarted"
    return victim
