"""Reliability and security of the real server (every process) on the tiny random model:
admission control under overload, request timeouts, body and field limits, API keys,
--protect-metrics (not /health), CORS, no prompt text in logs, malformed inter-process
messages, kill -9 of each kind of child under HTTP load, and SIGTERM under load. Loopback
only; every request and every wait is bounded in time."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import stat
import time

import httpx
import msgspec
import pytest
import zmq
from servers import (
    alive,
    asse_lines,
    engine_idle,
    error_of,
    http,
    metric,
    one_request,
    sse_events,
    start_server,
    stop_server,
    wait_until,
)

API_KEY = "reliability-key-123"
MAX_NUM_SEQS = 8
MAX_WAITING = 8
LIMIT = MAX_NUM_SEQS + MAX_WAITING
REQUEST_TIMEOUT_S = 5
MAX_MODEL_LEN = 256
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def limited(tiny_llama_dir, tmp_path_factory):
    """Small admission limit, a request timeout, a 1 MiB body limit, an API key."""
    log = tmp_path_factory.mktemp("limited") / "server.log"
    server = start_server(
        tiny_llama_dir,
        log,
        *("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)),
        *("--request-timeout", str(REQUEST_TIMEOUT_S), "--max-request-body-bytes", "1M"),
        *("--max-model-len", str(MAX_MODEL_LEN)),
        api_key=API_KEY,
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir, tmp_path_factory):
    """--protect-metrics, CORS for one origin, and request logging (the older spelling)."""
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    server = start_server(
        tiny_llama_dir,
        log,
        "--protect-metrics",
        *("--allowed-origins", "http://good.example"),
        "--log-requests",
        api_key=API_KEY,
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def faults(tiny_llama_dir, tmp_path_factory):
    """Two tokenizer and two detokenizer workers, for kill -9 and garbage on the sockets."""
    log = tmp_path_factory.mktemp("faults") / "server.log"
    server = start_server(
        tiny_llama_dir, log, "--tokenizer-workers", "2", "--detokenizer-workers", "2"
    )
    yield server
    stop_server(server)


def run_fast(coro):
    """Run a client burst on uvloop where there is one: the client shares the 2 cores with
    the server, and asyncio's own loop costs it several times as much per connection."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def settled_generation_tokens(server) -> float:
    """vllm:generation_tokens_total once two heartbeats (0.5 s apart) agree on it."""
    last = None
    for _ in range(40):
        count = metric(server.get("/metrics").text, "vllm:generation_tokens_total")
        if count == last:
            return count
        last = count
        time.sleep(0.6)
    raise AssertionError(f"generation_tokens_total kept moving: {last}")


# ---- the door, without a server ---------------------------------------------------------------


def _gate(body_timeout: float = 60.0):
    from types import SimpleNamespace

    from zllm.frontend.access.admission import Admission
    from zllm.frontend.access.middleware import Gate

    config = SimpleNamespace(
        api_keys=[],
        metrics_api_keys=[],
        protect_metrics=False,
        prefix_cache_isolation="none",
        max_request_body_bytes=100,
    )
    seen = []

    async def inner(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = Gate(inner, config, Admission(4), routes=[], body_timeout_s=body_timeout)  # type: ignore[arg-type]
    return gate, seen


def _call(gate, chunks: list[bytes], stall: bool = False) -> tuple[int, bytes]:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    sent = []

    async def receive():
        if chunks:
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks) or stall}
        await asyncio.sleep(3600 if stall else 0)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(gate(scope, receive, send), 10))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_gate_reads_bodies_within_limits():
    gate, seen = _gate()
    assert _call(gate, [b'{"a":', b" 1}"]) == (200, b"ok")
    assert seen == [b'{"a": 1}']  # the route got the whole body, replayed
    status, body = _call(gate, [b"x" * 60, b"x" * 60])  # no Content-Length: counted
    assert status == 413 and b"max-request-body-bytes" in body
    assert gate.admission.in_flight == 0  # released after each response
    gate, _ = _gate(body_timeout=0.2)
    status, body = _call(gate, [b'{"a":'], stall=True)  # a client trickling its body
    assert status == 408 and b"did not arrive" in body


def test_admission_counts_engine_requests():
    from zllm.frontend.access.admission import Admission, Ticket

    admission = Admission(limit=4)
    a, b, c = Ticket(), Ticket(), Ticket()
    admission.admit(a, 3)
    with pytest.raises(Exception) as refused:
        admission.admit(b, 2)  # 3 + 2 > 4
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    admission.admit(b, 1)
    assert admission.full() and admission.in_flight == 4
    admission.release(a)
    admission.release(a)  # releasing twice changes nothing
    assert admission.in_flight == 1 and not admission.full()
    admission.release(b)
    admission.admit(c, 9)  # larger than the whole limit: admitted when nothing runs
    assert admission.in_flight == 9 and admission.num_rejected == 1


# ---- overload ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_overload_gets_503_at_once_and_admitted_requests_complete(limited):
    """500 requests at once against room for 16: the excess is refused at once with 503 and
    Retry-After, every admitted one completes, and the number in flight never passes the
    limit."""
    body = json.dumps({"prompt": "The quick", "max_tokens": 64, "ignore_eos": True}).encode()
    auth = {"Authorization": f"Bearer {API_KEY}"}

    async def burst():
        peak, done = 0.0, False

        async def watch():
            nonlocal peak
            while not done:
                r = await http(limited.port, "GET", "/metrics", timeout=10)
                peak = max(peak, metric(r.body.decode(), "zllm:num_requests_in_flight"))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            calls = [http(limited.port, "POST", "/v1/completions", body, auth) for _ in range(500)]
            return await asyncio.wait_for(asyncio.gather(*calls), 120), peak
        finally:
            done = True
            await watcher

    start = time.monotonic()
    responses, peak = run_fast(burst())
    elapsed = time.monotonic() - start
    ok = [r for r in responses if r.status == 200]
    refused = [r for r in responses if r.status == 503]
    assert len(ok) + len(refused) == 500, {r.status for r in responses}
    assert LIMIT <= len(ok) < 500 and refused
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 64
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert error_of(r, 503)["code"] == "overloaded"
    slowest = max(r.elapsed_s for r in refused)
    # Refused at the door, not queued: a refused request that waited for a slot instead would
    # wait behind ~60 rounds of 8 generations of 64 tokens (tens of seconds). Measured: under
    # 1 s on an idle 2-core machine, where the client's 500 connections and the server share
    # the cores; 5 s leaves room for a loaded one.
    assert slowest < 5.0, f"a 503 took {slowest:.2f} s"
    assert peak <= LIMIT
    print(f"\noverload: {len(ok)} admitted, {len(refused)} refused in {elapsed:.2f} s; ")
    print(f"slowest 503 {slowest * 1000:.0f} ms, peak in flight {peak:.0f}")
    assert wait_until(lambda: engine_idle(limited), 10)
    assert "overloaded: " in limited.log_text()  # the operator sees it in the log


# ---- request timeout -----------------------------------------------------------------------


@pytest.mark.e2e
def test_request_timeout_aborts_and_frees_blocks(limited):
    """A request still running after --request-timeout gets a 504 (a stream: a final error
    event) and is aborted in the core, which frees its blocks. The executor is paused
    (SIGSTOP, well under --executor-timeout) once the stream has started, and the plain
    request is sent after that, so both are still running at the deadline however fast this
    machine is. How far the stream got before the pause depends on the machine, so the test
    judges the abort by what happens after it: once the executor resumes, it may finish the
    steps the core had already handed it, and nothing more."""
    body = {"prompt": ["Paged attention", "The quick"], "n": 4, "max_tokens": 250}
    body["ignore_eos"] = True
    executor = limited.children()["executor"]
    before = settled_generation_tokens(limited)

    async def both():
        async with httpx.AsyncClient(headers=limited.headers, timeout=60) as c:
            streaming = asyncio.Event()

            async def plain():
                start = time.monotonic()
                r = await c.post(limited.url + "/v1/completions", json=body)
                return r, time.monotonic() - start

            async def streamed():
                start = time.monotonic()
                lines = []
                stream_body = {**body, "stream": True}
                async with c.stream("POST", limited.url + "/v1/completions", json=stream_body) as r:
                    async for line in asse_lines(r.aiter_text()):
                        lines.append(line)
                        if line.startswith("data: {"):
                            streaming.set()
                return r.status_code, lines, time.monotonic() - start

            stream_task = asyncio.ensure_future(streamed())
            await asyncio.wait_for(streaming.wait(), 30)
            os.kill(executor, signal.SIGSTOP)
            try:
                results = await asyncio.wait_for(asyncio.gather(plain(), stream_task), 60)
                # Both have timed out; the executor is still paused, the core is not.
                return results, await asyncio.to_thread(settled_generation_tokens, limited)
            finally:
                os.kill(executor, signal.SIGCONT)

    ((r, plain_s), (status, lines, stream_s)), at_timeout = asyncio.run(both())
    error = error_of(r, 504)
    assert error["code"] == "request_timeout" and "timeout" in error["message"]
    assert status == 200
    events = sse_events(lines)
    assert events[-1]["error"]["code"] == "request_timeout"
    assert any(e.get("choices") for e in events[:-1])  # it did stream before timing out
    for elapsed in (plain_s, stream_s):
        # Not before the timeout (the server's clock starts after the client's), and ended by
        # it: with the executor paused nothing else could end them before the 60 s limit
        # above. 20 s of slack is for a loaded machine answering late.
        assert REQUEST_TIMEOUT_S - 0.5 < elapsed < REQUEST_TIMEOUT_S + 20
    assert wait_until(lambda: engine_idle(limited), 10)
    after = settled_generation_tokens(limited)
    # The core keeps at most MAX_STEPS_IN_FLIGHT (2) steps handed to the executor; those may
    # still run after SIGCONT. Had the abort not reached the core, the 16 sequences would go on
    # to their 250 tokens each.
    counts = f"before {before}, at the timeout {at_timeout}, after resuming {after}"
    assert after - at_timeout <= 2 * MAX_NUM_SEQS, counts
    assert "ran past the request timeout" in limited.log_text()
    assert limited.children()["executor"] == executor  # paused, not counted as dead


# ---- limits on the request -----------------------------------------------------------------


@pytest.mark.e2e
def test_body_size_limit(limited):
    big = b'{"prompt": "' + b"a" * (2 * BODY_LIMIT) + b'"}'
    # Content-Length says so: refused before the body is read.
    r = limited.post("/v1/completions", big)
    assert "max-request-body-bytes" in error_of(r, 413)["message"]

    def chunks():  # no Content-Length: counted while it streams in
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = limited.post("/v1/completions", chunks())
    error_of(r, 413)
    r = limited.post("/tokenize", big)
    error_of(r, 413)
    # Just under the limit is read (and refused for its length, not its size).
    r = limited.post("/v1/completions", b'{"prompt": "' + b"a " * (BODY_LIMIT // 2 - 20) + b'"}')
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert limited.healthy()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": -1}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x" * 257]}, "stop[1]"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop[0]"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
        ("/v1/completions", {"prompt": ["hi"] * 65}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),  # out of vocabulary
        ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, "prompt[1][1]"),
        ("/v1/completions", {"prompt": [2**64]}, "prompt[0]"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', "temperature"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7 * 7 }}"},
            "chat_template",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7 * 7 }}"},
            "chat_template",
        ),
        ("/v1/chat/completions", {"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_field_limits_name_the_field(limited, path, body, param):
    error = error_of(limited.post(path, body), 400)
    assert error["param"] == param, error


@pytest.mark.e2e
def test_wrong_content_type_is_refused(limited):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {**limited.headers, "Content-Type": content_type}
        error_of(limited.post("/v1/completions", body.encode(), headers=headers), 415)
    headers = {**limited.headers, "Content-Type": "application/json; charset=utf-8"}
    assert limited.post("/v1/completions", body.encode(), headers=headers).status_code == 200


# ---- security ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_api_key_guards_everything_but_health_and_metrics(limited):
    for path in ("/v1/models", "/openapi.json"):
        assert error_of(limited.get(path, headers={}), 401)["code"] == "invalid_api_key"
        error_of(limited.get(path, headers={"Authorization": "Bearer wrong"}), 401)
        error_of(limited.get(path, headers={"Authorization": "Bearer " + API_KEY + "x"}), 401)
        assert limited.get(path).status_code == 200
        assert limited.get(path, headers={"x-api-key": API_KEY}).status_code == 200
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
        error_of(limited.post(path, body, headers={}), 401)
    for path in ("/health", "/metrics", "/version"):
        assert limited.get(path, headers={}).status_code == 200


@pytest.mark.e2e
def test_protect_metrics_puts_metrics_behind_the_key_and_leaves_health_open(guarded):
    for path in ("/metrics", "/version", "/dashboard", "/dashboard/stats", "/v1/models"):
        error_of(guarded.get(path, headers={}), 401)
        assert guarded.get(path).status_code == 200
    assert guarded.get("/health", headers={}).status_code == 200  # load balancers' probe


@pytest.mark.e2e
def test_cors_off_by_default(limited):
    preflight = {
        "Origin": "http://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(limited.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = limited.get("/v1/models", headers={**limited.headers, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.e2e
def test_cors_for_allowed_origins(guarded):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(
        guarded.url + "/v1/completions", headers={**preflight, "Origin": "http://good.example"}
    )
    assert r.status_code == 200  # no API key needed for a preflight
    assert r.headers["access-control-allow-origin"] == "http://good.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(
        guarded.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in r.headers
    r = guarded.get("/v1/models", headers={**guarded.headers, "Origin": "http://good.example"})
    assert r.headers["access-control-allow-origin"] == "http://good.example"


@pytest.mark.e2e
def test_prompts_stay_out_of_logs_unless_asked(limited, guarded):
    marker = "zebra-quartz-marker"
    for server in (limited, guarded):
        r = server.post("/v1/completions", {"prompt": f"{marker} one", "max_tokens": 2})
        assert r.status_code == 200
        messages = [{"role": "user", "content": f"{marker} two"}]
        r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert r.status_code == 200
    assert marker not in limited.log_text()
    # --log-requests (the older spelling of --enable-log-requests) is consent to log them.
    assert wait_until(lambda: marker in guarded.log_text(), 5)


@pytest.mark.e2e
def test_ipc_sockets_live_in_a_private_directory(faults):
    mode = os.stat(faults.run_dir).st_mode
    assert stat.S_IMODE(mode) == 0o700
    names = os.listdir(faults.run_dir)
    assert "config.json" in names and "core_in" in names
    for name in names:
        assert os.stat(os.path.join(faults.run_dir, name)).st_uid == os.getuid()


# ---- malformed messages between processes ----------------------------------------------------


@pytest.mark.e2e
def test_malformed_ipc_messages_are_dropped(faults):
    """Garbage and wrong-typed msgpack on every socket a process binds to receive on: each
    is logged and dropped, no process dies, and the server goes on serving (and restarting
    children: the supervisor reads its inbox only then)."""
    before = faults.children()
    endpoints = faults.config()["endpoints"]
    targets = {
        "core_in": endpoints["engines"][0]["core_in"],
        "frontend_in": endpoints["frontend_in"],
        "supervisor_in": endpoints["supervisor_in"],
        "executor_in": endpoints["engines"][0]["executor_in"],
    }
    for i, addr in enumerate(endpoints["detokenizer_in"]):
        targets[f"detokenizer_in_{i}"] = addr
    enc = msgspec.msgpack.encode
    junk = [
        b"",
        b"\xff\xfe\x00garbage",
        os.urandom(4096),
        enc({"hello": "world"}),
        enc([1, "req", "not token ids", {}]),  # the EngineCoreRequest tag, wrong types
        enc([2, "not a list"]),  # AbortRequests
        enc([3, 5, "x"]),  # FinishSequence
        enc([4, [["x"]], [], True]),  # DetokenizerBatch
        enc([5, [[1, 2, 3]]]),  # FrontendBatch
        enc([6, None, None]),  # RequestRejected
        enc([7, "not a status section"]),  # EngineStats
        enc([8, 1, 2, 3]),  # ProcessEvent
        enc([9, ["dead"]]),  # EngineLifecycle
        enc([10, "not a client id"]),  # ClientGone
        enc([99, "unknown tag"]),
        enc([11, "core", "zero", "pid"]),  # ProcessReady, wrong types
        enc([0, [], [], {"a": "b"}, "x"]),  # SchedulerOutput, wrong types
        enc(2**64 - 1),
    ]
    ctx = zmq.Context()
    try:
        for addr in targets.values():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            for message in junk:
                sock.send(message)
            sock.close()
    finally:
        ctx.term()  # waits (up to the linger) until everything was handed over
    time.sleep(1.0)
    assert faults.children() == before, faults.log_tail()
    assert faults.healthy()
    r = faults.post("/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    log = faults.log_text()
    for role in ("core", "frontend", "executor", "detokenizer 0", "detokenizer 1"):
        assert re.search(rf"\[{role}\].*dropping a malformed", log), role
    # The supervisor reads its inbox while a child restarts: the junk must not stop that.
    os.kill(before["tokenizer 1"], signal.SIGKILL)
    assert wait_until(
        lambda: faults.children().get("tokenizer 1") not in (None, before["tokenizer 1"]), 30
    )
    assert wait_until(faults.healthy, 30), faults.log_tail()
    assert "zllm.runtime.supervisor: dropping a malformed" in faults.log_text()
    assert faults.proc.poll() is None


# ---- kill -9 under load ----------------------------------------------------------------------


def _log_time(line: str) -> float:
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["tokenizer 0", "detokenizer 0", "core", "executor", "frontend"])
def test_kill_9_under_http_load(faults, role):
    """SIGKILL one child while 32 requests (half streamed) run: each completes or gets a clear
    error, none hangs; the death is detected at once, from the exit rather than a timeout;
    /health turns 503 (or does not answer: the frontend is the one answering) and then 200;
    the server serves again."""
    assert wait_until(faults.healthy, 60)
    victim = faults.children()[role]
    health: list[tuple[float, int]] = []

    async def scenario():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            tasks = [
                asyncio.create_task(one_request(c, faults.url, i, stream=i % 2 == 0))
                for i in range(32)
            ]
            await asyncio.sleep(0.5)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)

            async def poll_health():
                deadline = time.monotonic() + 60
                seen_bad = False
                async with httpx.AsyncClient(timeout=2) as h:
                    while time.monotonic() < deadline:
                        try:
                            status = (await h.get(faults.url + "/health")).status_code
                        except httpx.HTTPError:
                            status = 0
                        health.append((time.time(), status))
                        seen_bad |= status != 200
                        if seen_bad and status == 200:
                            return
                        await asyncio.sleep(0.02)

            outcomes, _ = await asyncio.wait_for(
                asyncio.gather(asyncio.gather(*tasks), poll_health()), 90
            )
            return outcomes, killed_at

    outcomes, killed_at = asyncio.run(scenario())
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    allowed = {"ok", "status 503", "error event"} | ({"dropped"} if role == "frontend" else set())
    assert set(outcomes) <= allowed, counts
    if role in ("core", "executor", "frontend"):
        assert "ok" not in outcomes or outcomes.count("ok") < len(outcomes)
    else:
        assert "ok" in outcomes  # a worker's death costs at most the requests it served
    # Detected at once: the supervisor's log line, and /health. The supervisor looks for exits
    # every 0.1 s (measured: under 0.3 s to both, also on a loaded machine); the next way it
    # could learn of a death is a missed heartbeat after --engine-hang-timeout (30 s), and
    # for a worker there is none. 5 s is far below that, with room for a loaded machine.
    died = next(line for line in faults.log_text().splitlines() if f"(pid {victim}) died" in line)
    assert _log_time(died) - killed_at < 5.0, died
    first_bad = next(t for t, s in health if s != 200)
    assert first_bad - killed_at < 5.0
    assert health[-1][1] == 200, "the server did not come back"
    print(
        f"\nkill -9 {role}: {counts}; death logged after {_log_time(died) - killed_at:.2f} s, "
        f"/health not 200 after {first_bad - killed_at:.2f} s, "
        f"200 again after {health[-1][0] - killed_at:.1f} s"
    )
    assert wait_until(lambda: victim not in faults.children().values(), 5)
    r = faults.post("/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert wait_until(lambda: engine_idle(faults), 10)


# ---- SIGTERM under load --------------------------------------------------------------------


@pytest.mark.e2e
def test_sigterm_under_load_drains_then_aborts(tiny_llama_dir, tmp_path):
    """SIGTERM with short and very long requests in flight: the short ones (queued first)
    finish, the long ones end with a clear error at the drain timeout (a started stream: a
    final error event), the supervisor exits 0, no child is left, the socket directory is
    gone.

    It holds however fast or slow the machine is: the executor is paused (SIGSTOP, far under
    --executor-timeout) from before the first request until just after SIGTERM, so every
    request is admitted and the short ones are all still running at SIGTERM; and
    --max-num-seqs 16 runs the 16 short ones together (64 steps) but the long ones' 2 x 16
    prompts x 16 samples x 400 tokens only 16 sequences at a time: 12,800 steps, which no
    machine computes within the drain timeout (it would take under 0.4 ms a step)."""
    drain_s = 5
    server = start_server(
        tiny_llama_dir,
        tmp_path / "server.log",
        *("--drain-timeout", str(drain_s), "--max-num-seqs", "16"),
    )
    kids = list(server.children().values())
    executor = server.children()["executor"]
    short = {"prompt": "The quick", "max_tokens": 64, "ignore_eos": True}
    long = {
        "prompt": [f"Paged {i}" for i in range(16)],
        "n": 16,
        "max_tokens": 400,
        "ignore_eos": True,
    }

    async def scenario():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:

            async def call(body, stream):
                if not stream:
                    r = await c.post(server.url + "/v1/completions", json=body)
                    return r.status_code, r.json(), time.monotonic()
                async with c.stream(
                    "POST", server.url + "/v1/completions", json={**body, "stream": True}
                ) as r:
                    if r.status_code != 200:  # failed before its first event: a plain error
                        await r.aread()
                        return r.status_code, r.json(), time.monotonic()
                    events = sse_events([x async for x in asse_lines(r.aiter_text())])
                    return r.status_code, events, time.monotonic()

            async def admitted(count: int) -> None:
                """Until the frontend counts `count` engine requests (one per prompt) in."""
                deadline = time.monotonic() + 30
                while True:
                    text = (await c.get(server.url + "/metrics")).text
                    if metric(text, "zllm:num_requests_in_flight") >= count:
                        return
                    assert time.monotonic() < deadline, f"{count} requests never admitted"
                    await asyncio.sleep(0.05)

            os.kill(executor, signal.SIGSTOP)
            try:
                shorts = [asyncio.create_task(call(short, i % 2 == 0)) for i in range(16)]
                await admitted(16)  # in the one tokenizer's queue, so at the core, first
                longs = [asyncio.create_task(call(long, stream)) for stream in (True, False)]
                await admitted(16 + 2 * 16)
                sigterm_at = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:  # new work after SIGTERM: 503, or no listener at all
                    late = await c.post(server.url + "/v1/completions", json=short)
                    late_status = late.status_code
                except httpx.TransportError:
                    late_status = 0
            finally:
                os.kill(executor, signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*shorts, *longs), drain_s + 30)
            return results, late_status, sigterm_at

    try:
        results, late_status, sigterm_at = asyncio.run(scenario())
        code = server.proc.wait(drain_s + 30)
        elapsed = time.monotonic() - sigterm_at
    finally:
        stop_server(server)
    assert code == 0
    # The drain timeout, then six processes exiting (about 1 s on an idle machine); 15 s of
    # slack for a loaded 2-core machine. A child that had to be killed shows in the log.
    assert elapsed < drain_s + 15
    assert late_status in (0, 503)
    finished_at = []
    for status, payload, at in results[:16]:  # the short ones finished normally
        assert status == 200, payload
        if isinstance(payload, list):
            assert payload[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert payload["usage"]["completion_tokens"] == 64
        finished_at.append(at)
    assert max(finished_at) > sigterm_at  # some were still running at SIGTERM: drained
    for status, payload, _ in results[16:]:  # the long ones were cut at the drain timeout
        if isinstance(payload, list):
            assert status == 200, payload[-1]
            assert "drain timeout" in payload[-1].get("error", {}).get("message", ""), payload[-1]
        else:
            assert status == 503 and "drain timeout" in payload["error"]["message"], payload
    assert not [k for k in kids if alive(k)]
    assert not os.path.exists(server.run_dir)
    assert "killing it" not in server.log_text()
