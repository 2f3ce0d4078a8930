"""Resetting the prefix cache (vLLM's `POST /reset_prefix_cache`, `LLM.reset_prefix_cache()`):
every cached block no running request holds is forgotten and counted, pins are released, a
running request is not disturbed, and `?tiers=1` empties the cpu and disk KV tiers (their
files deleted). Block manager and tier index first, then offline, then a real server (with
data-parallel engines in test_data_parallel.py)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import httpx
import pytest
from servers import metric, sse_lines, start_server, stop_server, wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine import KVOffloadConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TieredKVConnector
from zllm.kv.block_hash import hash_full_blocks
from zllm.kv.tiers import TIER_DISK, parse_block_file_name

BS = 4
POOL_BYTES = 64 * 8192  # the tiny model: 8 KiB a block of 16 tokens, 64 blocks


def admit(bm: BlockManager, req_id: str, tokens: list[int]) -> None:
    hit = bm.find_cached_prefix(tokens)
    assert bm.allocate_slots(req_id, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit)


# ---- the core's bookkeeping ----------------------------------------------------------------


def test_reset_drops_free_cached_blocks_and_pins_but_not_a_running_requests():
    bm = BlockManager(16, BS, max_pinned_blocks=4)
    bm.record_kv_events()
    admit(bm, "done", list(range(9)))  # blocks 0, 1 full (cached), 2 partial
    assert bm.pin("done", num_tokens=4, until=1e12) == 1  # block 0 pinned
    bm.free("done")
    admit(bm, "running", list(range(100, 113)))  # three full blocks, held
    bm.take_kv_events()
    assert bm.drop_cached() == 2  # the pinned block and its free neighbour
    assert len(bm.pins) == 0
    assert bm.find_cached_prefix(list(range(9))).num_blocks == 0
    running = bm.find_cached_prefix(list(range(100, 113)))
    assert running.num_blocks == 3  # still cached: the request holds them
    stored, removed, cleared = bm.take_kv_events()
    assert stored == [] and not cleared  # the data-parallel router hears what left
    assert set(removed) == set(hash_full_blocks(list(range(8)), BS))
    bm.free("running")
    assert bm.drop_cached() == 3
    assert bm.num_free_blocks == 16 and bm.drop_cached() == 0


def test_clearing_the_tiers_drops_every_held_block_and_cancels_unsent_stores():
    config = KVOffloadConfig(cpu_bytes=4 * 100, disk_dir="/unused", disk_bytes=8 * 100)
    kv = TieredKVConnector(config, block_bytes=100, disk_blocks=[b"d1", b"d2"])
    kv.take_transfers()
    kv.evicted([(b"a", 5)])  # stored into both tiers this step: not yet sent
    assert kv.clear_stored_tiers() == [1, 3, 0]
    transfers = kv.take_transfers()
    assert transfers is not None and transfers.stores == []
    assert sorted(transfers.drops) == [(TIER_DISK, b"d1"), (TIER_DISK, b"d2")]
    assert kv.lookup([b"a"]) == [] and kv.lookup([b"d1"]) == []


# ---- offline ---------------------------------------------------------------------------------


def test_llm_reset_prefix_cache_forgets_prefixes(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [random.Random(1).randrange(3, 400) for _ in range(40)]}
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids


# ---- served ----------------------------------------------------------------------------------

KEY = "reset-key"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("reset")
    server = start_server(
        tiny_llama_dir, run / "serve.log", "--served-model-name", "tiny",
        "--kv-cache-memory-bytes", str(POOL_BYTES),
        "--kv-offload-dir", str(run / "tier"), "--kv-offload-disk-bytes", "1M",
        api_key=KEY,
    )  # fmt: skip
    server.tier_dir = run / "tier"
    yield server
    assert stop_server(server) == 0


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def complete(server, prompt: list[int], max_tokens: int = 1) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(response: dict) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def reset(server, query: str = "") -> dict:
    r = server.post("/reset_prefix_cache" + query, {})
    assert r.status_code == 200, r.text
    return r.json()


def block_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if parse_block_file_name(p.name) is not None]


@pytest.mark.e2e
def test_reset_needs_the_api_key_and_a_valid_flag(server):
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 401
    r = server.post("/reset_prefix_cache?tiers=maybe", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tiers"
    assert "/reset_prefix_cache" in server.get("/openapi.json").json()["paths"]


@pytest.mark.e2e
def test_a_prompt_is_cached_until_reset_and_the_count_is_its_blocks(server):
    reset(server)
    prompt = tokens(1, 3 * 16 + 5)  # three full blocks; the one sampled token fills no more
    assert cached(complete(server, prompt)) == 0
    assert cached(complete(server, prompt)) == 48
    answer = reset(server)
    assert answer == {"reset": True, "blocks_dropped": 3,
                      "tier_blocks_dropped": {"cpu": 0, "disk": 0}}  # fmt: skip
    assert cached(complete(server, prompt)) == 0  # and no tier had it: nothing was stored
    assert reset(server)["blocks_dropped"] == 3


@pytest.mark.e2e
def test_a_reset_while_a_request_streams_does_not_disturb_it(server):
    prompt = tokens(2, 70)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip

    def stream(during=None) -> str:
        text = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers=server.headers, timeout=60) as r:  # fmt: skip
            assert r.status_code == 200
            for i, line in enumerate(sse_lines(r.iter_text())):
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                if i == 4 and during is not None:
                    during()
        return "".join(text)

    alone = stream()
    reset(server)
    answers: list[dict] = []
    # Another request takes blocks right after the reset: were the stream's blocks handed
    # back, it would overwrite them.
    other = threading.Thread(target=complete, args=(server, tokens(3, 120), 8))

    def reset_and_serve_another() -> None:
        answers.append(reset(server))
        other.start()

    assert stream(reset_and_serve_another) == alone
    other.join()
    assert answers[0]["reset"] is True


@pytest.mark.e2e
def test_tiers_reset_deletes_the_disk_blocks_and_a_later_request_finds_no_tier_hit(server):
    first = tokens(4, 250)
    complete(server, first, 4)
    for seed in range(10, 16):  # more than the pool holds: the evicted blocks go to disk
        complete(server, tokens(seed, 300), 1)
    assert wait_until(lambda: len(block_files(server.tier_dir)) > 0, timeout=10)
    hits = "zllm:kv_offload_hits_total"
    before = metric(server.get("/metrics").text, hits)
    answer = reset(server, "?tiers=1")
    assert answer["tier_blocks_dropped"]["disk"] > 0 and answer["tier_blocks_dropped"]["cpu"] == 0
    assert wait_until(lambda: block_files(server.tier_dir) == [], timeout=10)
    assert cached(complete(server, first, 4)) == 0
    assert metric(server.get("/metrics").text, hits) == before
    # vLLM's spelling of the flag does the same (nothing is left to drop now).
    assert reset(server, "?reset_external=true")["tier_blocks_dropped"]["disk"] == 0
