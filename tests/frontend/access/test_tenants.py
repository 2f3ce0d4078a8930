"""Tenants served: who a request is for (API key, else X-Tenant, else the default), the
per-tenant series in /metrics, the flags, and the starvation test of `--scheduling-policy
fair` against fcfs on the real default model. Scheduler-level checks are in
tests/test_fair_share.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import time

import pytest
from servers import Server, error_of, start_server, wait_until

from zllm.config.engine_args import EngineArgs
from zllm.config.tenants import TenantPolicy, parse_tenant_weights


def test_tenant_weights_flag() -> None:
    assert parse_tenant_weights("key-1=3, alice=1.5") == {
        "key-1": TenantPolicy(weight=3.0),
        "alice": TenantPolicy(weight=1.5),
    }
    assert parse_tenant_weights('{"bob": 2}') == {"bob": TenantPolicy(weight=2.0)}
    for bad in ["alice", "alice=0", "alice=-1", "alice=nan", "a b=1", '["x"]', "x=inf"]:
        with pytest.raises(argparse.ArgumentTypeError, match="name=weight"):
            parse_tenant_weights(bad)


def test_tenant_weights_need_the_fair_policy(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="--scheduling-policy fair"):
        EngineArgs(tiny_llama_dir, tenant_weights={"a": 2.0}).create_engine_config()
    config = EngineArgs(
        tiny_llama_dir, scheduling_policy="fair", tenant_weights={"a": 2}
    ).create_engine_config()
    assert config.scheduler.tenant_weights == {"a": 2.0}


def tenant_series(server: Server, name: str) -> dict[str, float]:
    text = server.get("/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf'^{name}{{[^}}]*tenant="([^"]*)"}} (\S+)$', text, re.M)
    }


def complete(server: Server, headers: dict[str, str], max_tokens: int = 2):
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    return server.post("/v1/completions", body, headers=headers)


@pytest.mark.e2e
def test_served_tenant_from_the_x_tenant_header(tiny_llama_dir, engine_pool, tmp_path) -> None:
    # (An engine of its own: the tenants' series are the core's counts, from zero.)
    with engine_pool.serve(tiny_llama_dir, tmp_path / "server.log", shared=False) as server:
        for headers in [{"X-Tenant": "alice"}, {"X-Tenant": "alice"}, {"X-Tenant": "bob"}, {}]:
            assert complete(server, headers).status_code == 200
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        r = server.post("/v1/chat/completions", chat, headers={"X-Tenant": "bob"})
        assert r.status_code == 200
        for bad in ["two words", "x" * 65, "semi;colon"]:
            error = error_of(complete(server, {"X-Tenant": bad}), 400)
            assert error["param"] == "X-Tenant" and "X-Tenant" in error["message"]

        # (Requests are counted as they reach the core, tokens as they come: wait for a
        # heartbeat from after the last one finished.)
        def counted() -> bool:
            requests = tenant_series(server, "zllm:tenant_requests_total")
            running = tenant_series(server, "zllm:tenant_requests_running")
            return requests == {"alice": 2.0, "bob": 2.0, "default": 1.0} and not any(
                running.values()
            )

        assert wait_until(counted, 30), tenant_series(server, "zllm:tenant_requests_total")
        generated = tenant_series(server, "zllm:tenant_generation_tokens_total")
        assert generated["alice"] == 4 and generated["default"] == 2 and generated["bob"] == 5
        computed = tenant_series(server, "zllm:tenant_computed_tokens_total")
        assert computed["alice"] > 0 and computed["bob"] > computed["default"]
        assert tenant_series(server, "zllm:tenant_requests_running") == {
            "alice": 0.0, "bob": 0.0, "default": 0.0
        }  # fmt: skip
        assert complete(server, {}).status_code == 200  # still serving


@pytest.mark.e2e
def test_served_tenant_is_the_api_key(tiny_llama_dir, engine_pool, tmp_path) -> None:
    keys = ["sk-first-secret", "sk-second-secret"]
    # (An engine of its own: the tenants' series are the core's counts, from zero.)
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "server.log", "--api-key", keys[1], api_key=keys[0], shared=False
    ) as server:
        # With keys, the key decides: a header cannot claim another tenant (nor be refused).
        assert complete(server, {**server.headers, "X-Tenant": "not a name"}).status_code == 200
        second = {"Authorization": f"Bearer {keys[1]}", "X-Tenant": "key-1"}
        for _ in range(2):
            assert complete(server, second).status_code == 200
        assert wait_until(
            lambda: (
                tenant_series(server, "zllm:tenant_requests_total") == {"key-1": 1.0, "key-2": 2.0}
            ),
            5,
        ), tenant_series(server, "zllm:tenant_requests_total")
        assert not any(key in server.get("/metrics").text for key in keys)
        assert complete(server, {"X-Tenant": "key-1"}).status_code == 401


# ---- starvation: fair share against fcfs ------------------------------------------------------

NUM_FLOOD, NUM_PROBES = 200, 10
PROMPT_LEN, OUTPUT_LEN = 128, 64


def completion(rng: random.Random, stream: bool) -> bytes:
    """A 128-token prompt of random ids (no prefix-cache hits) asking for 64 tokens."""
    prompt = [rng.randrange(1000, 20000) for _ in range(PROMPT_LEN)]
    body = {"prompt": prompt, "max_tokens": OUTPUT_LEN, "ignore_eos": True, "stream": stream}
    return json.dumps(body).encode()


async def post(port: int, body: bytes, tenant: str, until_first_event: bool) -> float:
    """The time (monotonic) of the response's first SSE event (the first token), or of the
    whole response, on a raw connection (the client stays light beside the server)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = [
        "POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
        "Content-Type: application/json", f"X-Tenant: {tenant}", f"Content-Length: {len(body)}",
    ]  # fmt: skip
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    try:
        seen = b""
        while not (until_first_event and b"\ndata: " in seen):
            chunk = await reader.read(65536)
            if not chunk:
                break
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
        return time.monotonic()
    finally:
        writer.close()


async def probe_ttfts(
    port: int, rng: random.Random, timeout: float, resumed: asyncio.Future[float] | None = None
) -> list[float]:
    """Tenant B's 10 streamed requests at once: each one's TTFT (inf past `timeout`), from
    its send, or from `resumed` (the time the engine was let go; see probes_under_flood)."""

    async def one() -> float:
        sent = time.monotonic()
        first_token = asyncio.ensure_future(post(port, completion(rng, True), "B", True))
        start = sent if resumed is None else await asyncio.shield(resumed)
        try:
            left = timeout - (time.monotonic() - start)
            return await asyncio.wait_for(first_token, left) - start
        except asyncio.TimeoutError:
            return float("inf")

    return list(await asyncio.gather(*(one() for _ in range(NUM_PROBES))))


async def probes_under_flood(server: Server, rng: random.Random, timeout: float) -> list[float]:
    """Tenant A sends 200 requests at once; once its first 16 are decoding (so B does not
    arrive behind a 2,048-token prefill step that is already running), B's 10 probes.

    The probes reach the core together: the executor is paused (SIGSTOP, far under
    --executor-timeout) until the core holds all ten, and their TTFTs count from its
    release. Sent unpaused, they arrived over several steps on a loaded machine, and the
    first ones could finish (a probe leaves at its first token) and give their slots back to
    A before the last ones came, which preempted A again (CI saw more than 8)."""
    flood = [
        asyncio.ensure_future(post(server.port, completion(rng, False), "A", False))
        for _ in range(NUM_FLOOD)
    ]
    try:
        deadline = time.monotonic() + 60
        while tenant_series(server, "zllm:tenant_generation_tokens_total").get("A", 0) < 16:
            assert time.monotonic() < deadline, "tenant A's first requests never decoded"
            await asyncio.sleep(0.1)
        assert tenant_series(server, "zllm:tenant_requests_waiting")["A"] > 100
        resumed: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        executor = server.children()["executor"]
        os.kill(executor, signal.SIGSTOP)
        try:
            probes = asyncio.ensure_future(probe_ttfts(server.port, rng, timeout, resumed))
            deadline = time.monotonic() + 30
            while tenant_series(server, "zllm:tenant_requests_waiting").get("B", 0) < NUM_PROBES:
                assert time.monotonic() < deadline, "B's probes never all reached the core"
                await asyncio.sleep(0.1)
        finally:
            os.kill(executor, signal.SIGCONT)
        resumed.set_result(time.monotonic())
        return await probes
    finally:
        for task in flood:
            task.cancel()


def start_smollm2(smollm2_path: str, tmp_path, policy: str) -> Server:
    # A pool that holds every running sequence (16 x 192 tokens and B's), so blocks never
    # run out: what is measured is the policy, not preemption by lack of memory.
    return start_server(
        smollm2_path, tmp_path / f"{policy}.log", "--scheduling-policy", policy,
        "--max-num-seqs", "16", "--kv-cache-memory-bytes", "256M",
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.solo
def test_a_flooding_tenant_does_not_starve_another_under_fair_share(smollm2_path, tmp_path) -> None:
    """--max-num-seqs 16: tenant A sends 200 requests of 128 prompt / 64 output tokens at
    once, then tenant B sends 10. Under fair share B's median TTFT stays within 2x of B
    alone; under fcfs B waits behind A's queue (about 12 rounds of 16): more than 4x."""
    rng = random.Random(0)
    fair = start_smollm2(smollm2_path, tmp_path, "fair")
    try:
        asyncio.run(probe_ttfts(fair.port, rng, 60))  # warm-up
        alone = statistics.median(asyncio.run(probe_ttfts(fair.port, rng, 60)))
        loaded = asyncio.run(probes_under_flood(fair, rng, 8 * alone))
        fair_p50 = statistics.median(loaded)

        # The preemptions came as B's probes were admitted; a heartbeat carries them here.
        def yielded() -> bool:
            return tenant_series(fair, "zllm:tenant_preemptions_total").get("A", 0) >= 16 // 2

        assert wait_until(yielded, 30), tenant_series(fair, "zllm:tenant_preemptions_total")
        preempted = tenant_series(fair, "zllm:tenant_preemptions_total")
    finally:
        fair.kill()
    print(f"B alone p50 {alone:.2f} s; under A's flood, fair share: {loaded}")
    assert fair_p50 <= 2 * alone, (alone, loaded)
    # A yielded B its share of the batch (8 of 16) at once, and only that: no churn.
    assert preempted["A"] == 16 // 2 and preempted["B"] == 0, preempted

    fcfs = start_smollm2(smollm2_path, tmp_path, "fcfs")
    try:
        starved = asyncio.run(probes_under_flood(fcfs, rng, 4 * alone))
    finally:
        fcfs.kill()
    print(f"fcfs: {starved}")
    assert statistics.median(starved) > 4 * alone, (alone, starved)
