"""`zllm serve --data-parallel-size 2`: two engines behind one endpoint, through the openai
client. Requests sharing a prefix land on the engine that holds it (prefix-cache hits counted
per engine in /metrics), distinct ones spread, and a kill -9 of one engine's core under load
fails only that engine's requests while the other serves on. The router's rules one by one
are in tests/test_router.py."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
from served_answers import per_engine
from servers import start_server, stop_server, wait_until

pytestmark = pytest.mark.e2e

# ~300 tokens of the tiny tokenizer (of the 512 its model holds).
PREFIX = "Shared system prompt: " + " ".join(f"rule {i} is to be kind" for i in range(15))


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("dp")
    server = start_server(
        tiny_llama_dir, run / "server.log", "--data-parallel-size", "2", "--enable-sleep-mode",
        "--kv-cache-memory-bytes", "32M", "--kv-offload-bytes", "8M",
        "--kv-offload-dir", str(run / "tier"),
    )  # fmt: skip
    server.tier_dir = run / "tier"
    yield server
    assert stop_server(server) == 0


def test_two_engines_each_with_a_core_and_an_executor(dp_server):
    titles = dp_server.children().keys()
    assert {"core dp0", "core dp1", "executor dp0", "executor dp1"} <= titles
    assert dp_server.get("/health").status_code == 200
    text = dp_server.get("/metrics").text
    assert set(per_engine(text, "vllm:num_requests_waiting")) == {"0", "1"}


def test_requests_sharing_a_prefix_land_on_the_engine_that_holds_it(dp_server):
    client = client_of(dp_server)
    tokenized = dp_server.post("/tokenize", {"prompt": PREFIX}).json()
    # The full blocks of the prefix every prompt below shares (its last token may merge
    # with what follows).
    shared = (tokenized["count"] - 1) // 16 * 16
    assert shared >= 160
    before = dp_server.get("/metrics").text
    hits0 = per_engine(before, "vllm:prefix_cache_hits_total")
    complete(client, PREFIX + " First question?")
    followers = 5
    for i in range(followers):
        complete(client, PREFIX + f" Question number {i}?")

    def hits() -> dict[str, float]:
        text = dp_server.get("/metrics").text
        now = per_engine(text, "vllm:prefix_cache_hits_total")
        return {e: now[e] - hits0.get(e, 0.0) for e in now}

    # Counters come with each core's next heartbeat (every 0.5 s).
    assert wait_until(lambda: sum(hits().values()) >= followers * shared, 30), hits()
    gained = hits()
    holder = max(gained, key=gained.get)
    other = "1" if holder == "0" else "0"
    # Every follower hit the whole prefix on the holder; the other engine never saw it.
    assert gained[holder] >= followers * shared
    assert gained[other] == 0, gained


def test_requests_with_different_prompts_spread_over_the_engines(dp_server):
    name = "zllm:tenant_requests_total"
    before = per_engine(dp_server.get("/metrics").text, name)

    async def burst() -> None:
        client = openai.AsyncOpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        await asyncio.gather(
            *(
                client.completions.create(
                    model=model, prompt=f"{i} different {i * 7}", max_tokens=32
                )
                for i in range(8)
            )
        )

    asyncio.run(burst())

    def counts() -> dict[str, float]:
        now = per_engine(dp_server.get("/metrics").text, name)
        return {e: now[e] - before.get(e, 0.0) for e in now}

    assert wait_until(lambda: sum(counts().values()) == 8, 30), counts()
    assert min(counts().values()) >= 2, counts()


def test_both_engines_sleep_and_wake_together(dp_server):
    """POST /sleep reaches every engine: each executor releases its KV pool (level 1) or its
    weights too (level 2), requests are refused while asleep, and after /wake_up both
    engines answer as before. Sleeping stores each engine's cached prefixes down to its KV
    tiers: the disk tier of engine i is its own subdirectory engine-<i>."""
    from resident_memory import resident_bytes

    client = client_of(dp_server)
    prompts = [f"{i} sleeps {i * 13}" for i in range(6)]  # spread over both engines

    model = client.models.list().data[0].id

    def answers() -> list[str]:
        return [
            client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for p in prompts
        ]

    before = answers()
    children = dp_server.children()
    executors = [str(children[f"executor dp{e}"]) for e in (0, 1)]
    for level in (1, 2):
        awake = [resident_bytes(pid) for pid in executors]
        assert dp_server.post(f"/sleep?level={level}", {}).status_code == 200
        assert dp_server.get("/is_sleeping").json()["is_sleeping"]
        released = [a - resident_bytes(pid) for a, pid in zip(awake, executors, strict=True)]
        assert min(released) >= 0.8 * (32 << 20), (level, released)
        refused = dp_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "asleep" in refused.text
        assert dp_server.post("/wake_up", {}).status_code == 200
        assert wait_until(lambda: not dp_server.get("/is_sleeping").json()["is_sleeping"], 10)
        assert answers() == before

    def block_files(engine: int) -> list:
        return list((dp_server.tier_dir / f"engine-{engine}").rglob("*.zkv"))

    assert wait_until(lambda: block_files(0) and block_files(1), 10), "a disk tier per engine"
    assert sorted(p.name for p in dp_server.tier_dir.iterdir()) == ["engine-0", "engine-1"]


def test_a_prefix_cache_reset_reaches_every_engine_and_sums_their_counts(dp_server):
    """POST /reset_prefix_cache: every engine drops its cached blocks and the answer sums
    them; with ?tiers=1 every engine's disk tier is emptied too (the sleep test above
    stored blocks into both)."""
    import random
    import time

    name = "zllm:tenant_requests_total"
    dp_server.post("/reset_prefix_cache", {})  # what earlier tests left cached

    def settled() -> dict[str, float]:
        """The counts once the engines' heartbeats have told all (two reads agree)."""
        last = per_engine(dp_server.get("/metrics").text, name)
        while True:
            time.sleep(1.0)
            now = per_engine(dp_server.get("/metrics").text, name)
            if now == last:
                return now
            last = now

    before = settled()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(2 * 16 + 3)] for _ in range(8)]

    async def burst() -> None:  # at once, so the router spreads them
        client = openai.AsyncOpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        await asyncio.gather(
            *(client.completions.create(model=model, prompt=p, max_tokens=1) for p in prompts)
        )

    asyncio.run(burst())

    def counts() -> dict[str, float]:
        now = per_engine(dp_server.get("/metrics").text, name)
        return {e: now[e] - before.get(e, 0.0) for e in now}

    assert wait_until(lambda: sum(counts().values()) == 8, 30), counts()
    assert min(counts().values()) >= 1, counts()  # both engines hold some
    had_files = list(dp_server.tier_dir.rglob("*.zkv"))
    r = dp_server.post("/reset_prefix_cache?tiers=1", {})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["blocks_dropped"] == 8 * 2  # two full blocks a prompt, on either engine
    assert (answer["tier_blocks_dropped"]["disk"] > 0) == bool(had_files)
    assert wait_until(lambda: not list(dp_server.tier_dir.rglob("*.zkv")), 10)


async def stream_one(client: openai.AsyncOpenAI, model: str, i: int, started: list) -> str:
    """One streamed completion of 400 tokens: 'ok', or how it failed."""
    try:
        stream = await client.completions.create(
            model=model,
            prompt=f"Request {i} under load",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            if not tokens:
                started.append(i)
            tokens += 1
            finish = chunk.choices[0].finish_reason if chunk.choices else None
        return "ok" if finish == "length" else f"finished {finish}"
    except openai.APIStatusError as e:
        return f"status {e.status_code}"
    except openai.APIError as e:  # an error event in the stream
        assert "engine 1" in str(e), e
        return "error event"


def test_kill_9_of_one_engine_fails_its_requests_and_the_other_serves_on(tiny_llama_dir, tmp_path):
    server = start_server(
        tiny_llama_dir, tmp_path / "server.log", "--data-parallel-size", "2", "--max-num-seqs", "4"
    )
    try:
        victim = server.children()["core dp1"]

        async def scenario() -> list[str]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            model = (await client.models.list()).data[0].id
            started: list[int] = []
            tasks = [asyncio.create_task(stream_one(client, model, i, started)) for i in range(12)]
            while len(started) < 4:
                await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        outcomes = asyncio.run(scenario())
        assert set(outcomes) <= {"ok", "status 503", "error event"}, outcomes
        assert 1 <= outcomes.count("ok") < len(outcomes), outcomes

        # While engine 1 restarts the server stays healthy (200) and says which is down, and
        # new requests go to engine 0.
        health = server.get("/health")
        if health.content:  # (unless engine 1 is back already)
            assert health.status_code == 200
            assert health.json()["status"] == "degraded"
            assert "engine 1 down" in health.json()["message"]
        client = client_of(server)
        for i in range(3):
            assert complete(client, f"During the restart {i}").choices[0].text is not None

        def both_up() -> bool:
            r = server.get("/health")
            return r.status_code == 200 and not r.content

        assert wait_until(both_up, 90), server.get("/health").text
        assert server.children()["core dp1"] != victim
        assert "core 0 of engine 1" in server.log_text()
        # The restarted engine takes requests again (its counters started over at 0), once
        # the tokenizer has its first heartbeat.
        sent = []

        def engine_1_serves() -> bool:
            # (prompts that differ from their first block: no shared prefix)
            complete(client, f"{len(sent)} after the restart")
            sent.append(1)
            metrics = server.get("/metrics").text
            return per_engine(metrics, "zllm:tenant_requests_total").get("1", 0) > 0

        assert wait_until(engine_1_serves, 10, interval=0.2), f"{len(sent)} requests sent"
    finally:
        assert stop_server(server) == 0


def test_data_parallel_takes_kv_transfers_and_ray(tiny_llama_dir):
    from zllm.config.engine_args import EngineArgs
    from zllm.config.serve import ServerArgs
    from zllm.runtime.launch import serve_config_from

    # KV transfers compose (test_disaggregation.py: each consumer engine has its own ports).
    for role in ("kv_producer", "kv_consumer"):
        engine = EngineArgs(
            model=tiny_llama_dir, kv_transfer_config={"kv_role": role}
        ).create_engine_config()
        serve_config_from(engine, ServerArgs(data_parallel_size=2))
    config = serve_config_from(
        EngineArgs(model=tiny_llama_dir).create_engine_config(), ServerArgs(data_parallel_size=3)
    )
    assert len(config.endpoints.engines) == 3
    # Ray engines share one cluster (tests/test_ray.py).
    ray = EngineArgs(model=tiny_llama_dir, distributed_executor_backend="ray")
    ray_config = serve_config_from(ray.create_engine_config(), ServerArgs(data_parallel_size=2))
    assert len(ray_config.endpoints.engines) == 2
    assert len({e.core_in for e in config.endpoints.engines}) == 3
