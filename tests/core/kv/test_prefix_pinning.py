"""Prefix pinning (`cache_control`): a request's prompt prefix stays in the KV pool for its
TTL after it is computed, bounded by --max-pinned-bytes, and yields when a request could not
run otherwise. Offline through `LLM.generate(pin_prefix_s=...)`, then served: the OpenAI
routes' `cache_control` extra, Anthropic's cache_control blocks, refusals and /metrics."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from servers import metric, wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.errors import ParamError
from zllm.protocol import CachePin, ModelRunnerOutput

POOL_BYTES = 64 * 8192  # the tiny model: 8 KiB a block of 16 tokens, 64 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(seed: int, n: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]}


def flush(llm: LLM, seed: int = 50) -> None:
    """Traffic that needs every unpinned block of the pool."""
    for i in range(3):
        llm.generate([prompt(seed + 2 * i, 300), prompt(seed + 2 * i + 1, 300)], GREEDY)


@pytest.fixture
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, max_pinned_bytes=20 * 8192)


def test_a_pinned_prefix_survives_other_traffic(llm):
    system = prompt(1, 250)
    reference = llm.generate([system], GREEDY, use_tqdm=False)[0]
    flush(llm)
    assert llm.generate([system], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0  # unpinned
    llm.generate([system], GREEDY, use_tqdm=False, pin_prefix_s=60)
    assert llm.engine.heartbeat().pins.pinned_blocks == 15  # 250 tokens: 15 full blocks
    flush(llm, seed=70)
    again = llm.generate([system], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 240
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids


def test_pins_expire(llm):
    system = prompt(2, 250)
    llm.generate([system], GREEDY, use_tqdm=False, pin_prefix_s=0.3)
    time.sleep(0.4)
    flush(llm)  # its first step unpins (expired), then the traffic evicts the blocks
    assert llm.engine.heartbeat().pins.pinned_blocks == 0
    assert llm.generate([system], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_pinned_bytes_are_bounded_leading_blocks_first(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, max_pinned_bytes=5 * 8192)
    system = prompt(3, 250)
    llm.generate([system], GREEDY, use_tqdm=False, pin_prefix_s=60)
    stats = llm.engine.heartbeat()
    assert (stats.pins.pinned_blocks, stats.pins.max_pinned_blocks) == (5, 5)
    flush(llm)
    assert llm.generate([system], GREEDY, use_tqdm=False)[0].num_cached_tokens == 80


def test_pinning_off_serves_unpinned(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, max_pinned_bytes=0)
    llm.generate([prompt(4, 250)], GREEDY, use_tqdm=False, pin_prefix_s=60)
    assert llm.engine.heartbeat().pins.pinned_blocks == 0
    with pytest.raises(ParamError, match="pin_prefix_s"):
        llm.generate([prompt(4, 10)], GREEDY, use_tqdm=False, pin_prefix_s=-1)


def test_pins_yield_to_a_request_that_needs_the_whole_pool(tiny_llama_dir):
    """Pinned blocks are not a reservation: a request the pool could only hold without them
    still runs (the pins are released), with the output of an engine without pins."""
    pool = 32 * 8192
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=pool, max_pinned_bytes=24 * 8192)
    llm.generate([prompt(5, 330)], GREEDY, use_tqdm=False, pin_prefix_s=60)  # 20 blocks
    assert llm.engine.heartbeat().pins.pinned_blocks == 20
    big = prompt(6, 400)  # 26 blocks with its output: more than 32 - 20
    out = llm.generate([big], GREEDY, use_tqdm=False)[0]
    assert llm.engine.heartbeat().pins.pinned_blocks == 0
    fresh = LLM(tiny_llama_dir, kv_cache_memory_bytes=pool)
    assert out.outputs[0].token_ids == fresh.generate([big], GREEDY)[0].outputs[0].token_ids


def test_re_pinning_the_same_blocks_keeps_the_expiry_heap_bounded():
    """A shared prefix pinned again by request after request pushes a later time each time;
    the heap's stale entries are rebuilt away (issue 56), and expiry still honours the
    latest time of each block."""
    from zllm.core.kv.free_blocks import KVBlock
    from zllm.core.kv.prefix_pins import PrefixPins

    pins = PrefixPins(max_blocks=8)
    blocks = [KVBlock(i) for i in range(4)]
    for t in range(10_000):
        for b in blocks:
            assert pins.add(b, until=float(t))
    assert pins.heap_entries <= 2 * len(pins) + 64
    assert [b.ref_count for b in blocks] == [1, 1, 1, 1]  # one reference per pinned block
    assert pins.expired(now=9_998.0) == []  # each block's latest time is 9,999
    assert sorted(b.block_id for b in pins.expired(now=9_999.0)) == [0, 1, 2, 3]
    assert len(pins) == 0


def test_a_running_request_that_would_be_preempted_releases_pins_instead():
    """At the scheduler: the last running request runs out of blocks; pins go, not it."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40)
    bm = BlockManager(10, 4, max_pinned_blocks=10)
    sched = Scheduler(config, bm)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add_request(Request("p", list(range(100, 117)), params, cache_pin=CachePin(60, 16)))
    so = sched.schedule()  # p's prompt: 17 tokens, 5 blocks, 4 full ones pinned
    sched.abort_requests(["p"])
    assert len(bm.pins) == 4 and bm.num_free_blocks == 6
    sched.add_request(Request("a", list(range(8)), params))
    for _ in range(30):
        so = sched.schedule()
        ids = [r for r in so.num_scheduled_tokens if sched.requests[r].num_computed_tokens
               == sched.requests[r].num_tokens]  # fmt: skip
        sched.update_from_output(so, ModelRunnerOutput(so.step_id, ids, [[7] for _ in ids]))
        if "a" not in sched.requests:
            break
    assert "a" not in sched.requests and sched.num_preemptions == 0
    assert len(bm.pins) == 0  # 8 + 30 tokens needed all 10 blocks


# ---- served -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, engine_pool):
    log = tmp_path_factory.mktemp("pinning") / "server.log"
    with engine_pool.serve(
        tiny_llama_dir, log, "--served-model-name", "tiny",
        "--kv-cache-memory-bytes", str(POOL_BYTES), "--max-pinned-bytes", str(40 * 8192),
    ) as server:  # fmt: skip
        yield server


def flush_served(server, seed: int) -> None:
    for i in range(4):  # 4 x 19 blocks: more than what 64 blocks less the pins can keep
        body = {"model": "tiny", "prompt": prompt(seed + i, 300)["prompt_token_ids"],
                "max_tokens": 4}  # fmt: skip
        assert server.post("/v1/completions", body).status_code == 200


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.e2e
def test_served_cache_control_pins_the_prompt(server):
    body = {
        "model": "tiny", "prompt": prompt(10, 250)["prompt_token_ids"], "max_tokens": 4,
        "cache_control": {"type": "ephemeral", "ttl": "5m"},
    }  # fmt: skip
    assert cached_tokens(server.post("/v1/completions", body)) == 0

    def pinned() -> float:  # the core's heartbeat reaches /metrics every 0.5 s
        return metric(server.get("/metrics").text, "zllm:kv_pinned_blocks")

    assert wait_until(lambda: pinned() >= 15, timeout=10)
    assert metric(server.get("/metrics").text, "zllm:kv_max_pinned_bytes") == 40 * 8192
    flush_served(server, 100)
    del body["cache_control"]
    assert cached_tokens(server.post("/v1/completions", body)) == 240


@pytest.mark.e2e
@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"type": "persistent"}, "must be 'ephemeral'"),
        ({"type": "ephemeral", "ttl": "forever"}, "duration"),
        ({"type": "ephemeral", "ttl": "48h"}, "between 0 and 24h"),
        ({"type": "ephemeral", "scope": "global"}, "unknown fields"),
        ("ephemeral", "Expected `object | null`, got `str`"),
    ],
)
def test_served_cache_control_refusals_name_the_field(server, value, fragment):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "cache_control": value}  # fmt: skip
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"].startswith("cache_control")


@pytest.mark.e2e
def test_anthropic_cache_control_pins_up_to_the_marked_block(server):
    """A system prompt marked with cache_control is pinned, the turns after it are not."""
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    system = " ".join(rng.choice(words) for _ in range(50))  # ~250 tokens here
    turn = " ".join(rng.choice(words) for _ in range(12))
    body = {
        "model": "tiny", "max_tokens": 4,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": turn}],
    }  # fmt: skip
    first = server.post("/v1/messages", body)
    assert first.status_code == 200, first.text
    count = server.post(
        "/v1/messages/count_tokens",
        {"model": "tiny", "system": system, "messages": [{"role": "user", "content": "x"}]},
    ).json()["input_tokens"]
    flush_served(server, 200)
    body["messages"][0]["content"] = turn + " more"  # same system prompt, another turn
    again = server.post("/v1/messages", body).json()["usage"]
    # The system prompt's full blocks came from the pinned prefix; the turns' did not.
    assert 0 < again["cache_read_input_tokens"] <= count
    assert again["cache_read_input_tokens"] >= count - 16 - 8  # all but its last partial block
    bad = dict(body, system=[{"type": "text", "text": "x", "cache_control": {"type": "x"}}])
    r = server.post("/v1/messages", bad)
    assert r.status_code == 400 and r.json()["type"] == "error"
