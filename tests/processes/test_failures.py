"""Failures the supervisor and the core close, on the real server (every process) with the
tiny random model: a hung core is restarted, a dead frontend's requests stop running, and a
second death during a restart is handled at once. Every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from servers import asse_lines, error_of, metric, sse_events, start_server, stop_server, wait_until

pytestmark = pytest.mark.e2e

HANG_TIMEOUT_S = 3
MAX_TOKENS = 400  # the tiny model's context is 512


async def _stream(client: httpx.AsyncClient, url: str, i: int, flowing: asyncio.Event) -> str:
    """One streamed completion: 'ok', 'status N' or 'error event' ('dropped' if the
    connection itself goes). Sets `flowing` once tokens arrive."""
    body = {"prompt": f"Paged attention {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    body["stream"] = True
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                error_of(r, r.status_code)
                return f"status {r.status_code}"
            lines = []
            async for line in asse_lines(r.aiter_text()):
                lines.append(line)
                if line.startswith("data: {"):
                    flowing.set()
        events = sse_events(lines)
        return "error event" if "error" in events[-1] else "ok"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "dropped"


def _generation_tokens(server) -> float:
    return metric(server.get("/metrics").text, "vllm:generation_tokens_total")


def _engine_idle(server) -> bool:
    try:
        text = server.get("/metrics", timeout=5).text
    except httpx.HTTPError:
        return False  # (a frontend restarting)
    return (
        metric(text, "vllm:num_requests_running") == 0
        and metric(text, "vllm:num_requests_waiting") == 0
        and metric(text, "vllm:kv_cache_usage_perc") == 0
    )


def test_hung_core_is_restarted(tiny_llama_dir, tmp_path):
    """SIGSTOP the core under load (alive but silent): after --engine-hang-timeout without a
    heartbeat the supervisor treats it as dead: in-flight requests get a 503 (or a final
    error event), the engine restarts, and the server serves again."""
    server = start_server(
        tiny_llama_dir, tmp_path / "server.log", "--engine-hang-timeout", str(HANG_TIMEOUT_S)
    )
    core = server.children()["core"]
    try:

        async def scenario():
            flowing = asyncio.Event()
            async with httpx.AsyncClient(timeout=60) as c:
                tasks = [asyncio.create_task(_stream(c, server.url, i, flowing)) for i in range(8)]
                await asyncio.wait_for(flowing.wait(), 30)
                os.kill(core, signal.SIGSTOP)
                stopped_at = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return outcomes, time.monotonic() - stopped_at

        outcomes, failed_after = asyncio.run(scenario())
        assert set(outcomes) <= {"error event", "status 503"}, outcomes
        # Failed by the hang detection (the last heartbeat may predate the stop by up to
        # 0.5 s), not by some client timeout (60 s).
        assert HANG_TIMEOUT_S - 1 <= failed_after < HANG_TIMEOUT_S + 20, failed_after
        assert re.search(
            r"core 0 \(pid \d+\) sent no heartbeat for [\d.]+ s \(hung\)", server.log_text()
        )
        assert wait_until(server.healthy, 60), server.log_tail()
        assert server.children()["core"] != core
        r = server.post(
            "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        try:
            os.kill(core, signal.SIGCONT)  # (if the supervisor did not kill it)
        except ProcessLookupError:
            pass
        stop_server(server)


def test_dead_frontends_requests_are_aborted(tiny_llama_dir, tmp_path):
    """kill -9 the frontend under 32 streaming requests: the core aborts what that frontend
    sent (nobody can read it any more), so nothing keeps running and every KV block comes
    back, long before the requests would have finished on their own."""
    server = start_server(tiny_llama_dir, tmp_path / "server.log", "--max-num-seqs", "64")
    try:
        before = _generation_tokens(server)
        frontend = server.children()["frontend"]

        async def scenario():
            flowing = asyncio.Event()
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                tasks = [asyncio.create_task(_stream(c, server.url, i, flowing)) for i in range(32)]
                await asyncio.wait_for(flowing.wait(), 30)
                os.kill(frontend, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        outcomes = asyncio.run(scenario())
        assert "dropped" in outcomes  # their frontend is gone
        assert wait_until(server.healthy, 60), server.log_tail()  # a new one is up

        # (A new frontend reads zeros until its first heartbeat: idle, with tokens counted.)
        def settled() -> bool:
            return _engine_idle(server) and _generation_tokens(server) > before

        assert wait_until(settled, 30), server.log_tail()
        generated = _generation_tokens(server) - before
        assert generated < 32 * MAX_TOKENS / 2, generated  # stopped, not run to the end
        aborted = re.search(r"client \d+ is gone: aborted its (\d+) request", server.log_text())
        assert aborted and int(aborted.group(1)) >= 1, server.log_tail()
        r = server.post(
            "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        stop_server(server)


def test_second_death_during_a_restart_is_handled_at_once(tiny_llama_dir, tmp_path):
    """Kill the core and, within 100 ms, a tokenizer: the supervisor notices the tokenizer's
    death while the engine is still restarting (restarts do not block the watch loop), and
    both come back."""
    server = start_server(tiny_llama_dir, tmp_path / "server.log")
    try:
        before = server.children()
        os.kill(before["core"], signal.SIGKILL)
        time.sleep(0.05)
        os.kill(before["tokenizer 0"], signal.SIGKILL)
        killed_at = time.time()

        def back() -> bool:
            now = server.children()
            return (
                now.get("core") not in (None, before["core"])
                and now.get("tokenizer 0") not in (None, before["tokenizer 0"])
                and server.healthy()
            )

        assert wait_until(back, 60), server.log_tail()
        log = server.log_text().splitlines()
        tokenizer_death = next(
            i for i, line in enumerate(log) if f"(pid {before['tokenizer 0']}) died" in line
        )
        restarted = next(i for i, line in enumerate(log) if "engine restarted" in line)
        assert tokenizer_death < restarted, "\n".join(log[-40:])
        died_at = _log_time(log[tokenizer_death])
        # Seen within a couple of watch passes; an engine restart takes seconds.
        assert died_at - killed_at < 2.0, log[tokenizer_death]
        r = server.post(
            "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        stop_server(server)


def _log_time(line: str) -> float:
    import datetime

    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()
