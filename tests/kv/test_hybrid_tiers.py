"""KV tiers whose loads can fail (the disk tier, a consumer's remote buffer) with several KV
cache groups (the hybrid KV cache): a hit that loads from them is prefetched in a step of
its own (core/kv/prefetch.py), then the request is admitted again through the lookup.

The scheduler's flow as an executable spec (exact block ids and transfers), then a tiny
Gemma 3 engine: an evicted prefix comes back from the CPU or the disk tier, and a corrupt disk block is
recomputed, each with the outputs of recomputing.
"""

from __future__ import annotations

import random

import pytest
from kv_tiers import (
    GREEDY,
    assert_same_outputs,
    damage_a_disk_block,
    flush_pool,
    random_prompt,
    tiered_connector,
)

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.config.kv_transfer import KVTransferConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TieredKVConnector
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.kv.block_hash import group_block_key, hash_full_blocks
from zllm.kv.tiers import TIER_CPU, TIER_DISK, TIER_REMOTE
from zllm.protocol import KVTransferParams, ModelRunnerOutput

BS = 4
PROMPT = list(range(50, 63))  # 13 tokens: 3 full blocks a hit can take
HASHES = hash_full_blocks(PROMPT[:12], BS)
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def hybrid_scheduler() -> Scheduler:
    """A full group and a sliding one of window 4 (a hit of k blocks needs its block k-1),
    an empty pool, and tiers holding a's prefix: every group's block on disk but the
    sliding group's blocks 0 and 1, of which the cpu tier holds block 1."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    bm = BlockManager(16, BS, sliding_windows=(None, 4), record_evictions=True)
    kv = tiered_connector(cpu_blocks=4, disk_blocks=16)
    for i in range(3):
        kv.tiers[TIER_DISK].add(group_block_key(HASHES[i], 0), set())
    kv.tiers[TIER_DISK].add(group_block_key(HASHES[2], 1), set())
    kv.tiers[TIER_CPU].add(group_block_key(HASHES[1], 1), set())
    return Scheduler(config, bm, kv_connector=kv)


def prefetch_step(sched: Scheduler):
    """c (the prefix) and d (other tokens) arrive: c's hit loads from the disk tier in this
    step and c computes nothing in it; d goes ahead of it."""
    sched.add_request(Request("c", PROMPT, ONE_TOKEN))
    sched.add_request(Request("d", list(range(300, 306)), ONE_TOKEN))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"d": 6}
    assert [r.req_id for r in so.new_requests] == ["d"]
    keys = [group_block_key(HASHES[i], 0) for i in range(3)] + [group_block_key(HASHES[2], 1)]
    assert so.kv_transfers.loads == [(TIER_DISK, key, b) for b, key in enumerate(keys)]
    assert sched.block_manager.group_block_ids("c") == [[0, 1, 2], [-1, -1, 3]]
    # Not a hit for anyone until the step returns (its bytes may be garbage until then).
    assert all(sched.block_manager.pool.blocks[b].block_hash is None for b in range(4))
    ahead = sched.schedule()  # a step scheduled while the prefetch is out: c still waits
    assert "c" not in ahead.num_scheduled_tokens and ahead.kv_transfers is None
    return so


def test_a_hybrid_hit_from_the_disk_tier_loads_a_step_ahead_of_its_compute():
    sched = hybrid_scheduler()
    bm, kv = sched.block_manager, sched.kv.tiers
    so = prefetch_step(sched)
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["d"], [[1]]))
    c = sched.requests["c"]
    assert c.num_prefetched_tokens == 12 and bm.num_held_blocks("c") == 0
    so = sched.schedule()  # c again, through the lookup: the pool holds every block now
    assert so.num_scheduled_tokens == {"c": 1} and so.kv_transfers is None
    (new,) = so.new_requests
    assert new.num_computed_tokens == 12 and new.block_ids == [[0, 1, 2, 7], [-1, -1, 3, 5]]
    assert c.num_cached_tokens == 12
    assert kv.hit_tokens == [0, 12, 0] and bm.prefix_cache_hits == 0  # a block counts once


def test_a_failed_prefetch_load_gives_a_shorter_hit():
    """The full group's block 2 fails to load: its tier copy is forgotten, its pool block
    never cached; c's next lookup stops before it (the sliding group's block 1 comes from
    the cpu tier, in the admitting step: those loads cannot fail) and computes the rest."""
    sched = hybrid_scheduler()
    bm, kv = sched.block_manager, sched.kv.tiers
    so = prefetch_step(sched)
    failed = [(TIER_DISK, HASHES[2])]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["d"], [[1]], kv_load_failed=failed))
    assert sched.requests["c"].num_prefetched_tokens == 8
    assert kv.load_failures == [0, 1, 0] and HASHES[2] not in kv.tiers[TIER_DISK]
    assert HASHES[2] not in bm.pool.cached_blocks[0]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 5}
    (new,) = so.new_requests
    assert new.num_computed_tokens == 8 and new.block_ids == [[0, 1, 5, 2], [-1, 7, 8, 9]]
    assert so.kv_transfers.loads == [(TIER_CPU, group_block_key(HASHES[1], 1), 7)]
    assert so.kv_transfers.drops == [(TIER_DISK, HASHES[2])]  # the damaged file goes
    assert sched.requests["c"].num_cached_tokens == 8


def test_a_request_prefetches_at_most_once():
    """Its prefetched blocks leave the pool before it is admitted again (stored to the
    tiers): its next lookup sees only the cpu tier, so it computes instead of prefetching
    again (no loop)."""
    sched = hybrid_scheduler()
    bm, kv = sched.block_manager, sched.kv.tiers
    so = prefetch_step(sched)
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["d"], [[1]]))
    kv.evicted(bm.evict_cached())
    kv.take_transfers()
    assert HASHES[0] in kv.tiers[TIER_DISK]
    so = sched.schedule()
    assert so.num_scheduled_tokens["c"] == 13 and so.new_requests[0].num_computed_tokens == 0
    assert so.kv_transfers is None or not so.kv_transfers.loads


def test_a_request_aborted_during_its_prefetch_leaves_nothing_cached():
    sched = hybrid_scheduler()
    bm = sched.block_manager
    so = prefetch_step(sched)
    sched.abort_requests(["c"])
    assert bm.num_held_blocks("c") == 0
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["d"], [[1]]))
    assert not any(h in cache for cache in bm.pool.cached_blocks for h in HASHES)
    assert not sched.kv.prefetches


# ---- tiny Gemma 3 and Mistral engines with a CPU or disk tier -------------------------------
def windowed_model(directory, kind: str) -> tuple[str, int, list, list]:
    """A tiny windowed model, its pool of 64 blocks, two prompts, and what recomputing them
    gives: Gemma 3 (a full group, two sliding ones of window 8: the hybrid cache) or
    Mistral (every layer sliding, window 16: one group that frees blocks)."""
    from tiny_models import tiny_gemma3_overrides, write_tiny_model

    from zllm.config.engine_args import EngineArgs
    from zllm.config.kv_layout import block_bytes
    from zllm.kv.cache_groups import kv_cache_groups

    if kind == "gemma3":
        path = str(write_tiny_model(directory, **tiny_gemma3_overrides(8)))
    else:
        path = str(write_tiny_model(directory, "mistral", sliding_window=16))
    config = EngineArgs(model=path).create_engine_config()
    groups = kv_cache_groups(config.arch)
    assert len(groups) == (3 if kind == "gemma3" else 1) and groups[-1].sliding_window
    pool = 64 * block_bytes(config)
    rng = random.Random(1)
    prompts = [random_prompt(rng, 250), random_prompt(rng, 90)]
    reference = LLM(path, kv_cache_memory_bytes=pool).generate(prompts, GREEDY, use_tqdm=False)
    return path, pool, prompts, reference


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return windowed_model(tmp_path_factory.mktemp("gemma"), "gemma3")


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request, tmp_path_factory):
    if request.param == "gemma3":
        return request.getfixturevalue("gemma")
    return windowed_model(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.mark.parametrize("tier", [TIER_CPU, TIER_DISK], ids=["cpu", "disk"])
def test_a_windowed_models_evicted_prefix_comes_back_from_a_tier(windowed, tier, tmp_path):
    """Each group's blocks (Gemma 3: a full group, two sliding ones; Mistral: one sliding
    group) go to the tier under their own keys and come back, a sliding group's those of the
    window at the hit's end, with the outputs of recomputing them."""
    path, pool, prompts, reference = windowed
    offload = {"kv_offload_bytes": 8 * pool} if tier == TIER_CPU else {}
    if tier == TIER_DISK:
        offload["kv_offload_dir"] = str(tmp_path)
    llm = LLM(path, kv_cache_memory_bytes=pool, **offload)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    flush_pool(llm, random.Random(2))
    stats = llm.engine.heartbeat()  # (one struct, filled in place by each call)
    tier_hits, pool_hits = stats.kv_tiers.hits[tier], stats.prefix_cache.hits
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.engine.heartbeat()
    assert again[0].num_cached_tokens == 240 and again[1].num_cached_tokens == 80
    tier_hits = stats.kv_tiers.hits[tier] - tier_hits
    pool_hits = stats.prefix_cache.hits - pool_hits
    assert tier_hits > 0 and tier_hits + pool_hits == 320
    assert stats.kv_tiers.load_failures == [0, 0, 0]
    for ours, ref, earlier in zip(again, reference, first, strict=True):
        assert_same_outputs(ours, ref)
        assert_same_outputs(earlier, ref)


def test_a_hybrid_models_corrupt_disk_block_is_recomputed(gemma, tmp_path):
    path, pool, prompts, reference = gemma
    llm = LLM(path, kv_cache_memory_bytes=pool, kv_offload_dir=str(tmp_path))
    victim = damage_a_disk_block(llm, prompts[0])
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert_same_outputs(again, reference[0])
    stats = llm.engine.heartbeat()
    assert stats.kv_tiers.load_failures[TIER_DISK] == 1
    assert again.num_cached_tokens < 240  # its hit stopped before the failed block
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    assert not victim.exists()  # the core forgot it and the executor deleted it


# ---- KV transfers with several groups --------------------------------------------------------------
def hybrid_disagg_scheduler(role: str) -> Scheduler:
    transfer = KVTransferConfig(role=role, buffer_bytes=64, wait_timeout_s=60.0)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    bm = BlockManager(32, BS, sliding_windows=(None, 4), record_evictions=True)
    kv = TieredKVConnector(None, block_bytes=1, remote_bytes=64) if transfer.consumes else None
    return Scheduler(config, bm, kv_connector=kv, kv_transfer=transfer)


def marked(req_id: str, **flags) -> Request:
    return Request(req_id, PROMPT, ONE_TOKEN, kv_transfer=KVTransferParams(**flags))


def test_a_hybrid_producer_sends_every_groups_blocks_a_hit_needs():
    """The full group's every block and the sliding group's in the window of the prompt's
    end (block 2), each under its group's key."""
    sched = hybrid_disagg_scheduler("kv_producer")
    sched.add_request(marked("p", do_remote_decode=True))
    so = sched.schedule()
    full, sliding = sched.block_manager.group_block_ids("p")
    assert so.kv_sends == [
        *((HASHES[i], full[i]) for i in range(3)),
        (group_block_key(HASHES[2], 1), sliding[2]),
    ]
    assert sched.kv.num_sent_blocks == 4


def test_a_hybrid_consumer_waits_for_every_groups_blocks_then_prefetches_them():
    sched = hybrid_disagg_scheduler("kv_consumer")
    remote = sched.kv.tiers
    sched.add_request(marked("c", do_remote_prefill=True))
    remote.received(HASHES, [])  # the full group's blocks: the sliding one's is yet to come
    so = sched.schedule()
    assert so.num_scheduled_tokens == {} and so.kv_transfers is None  # it waits
    remote.received([group_block_key(HASHES[2], 1)], [])
    so = sched.schedule()  # its loads, in a step where it computes nothing
    assert so.num_scheduled_tokens == {} and not so.new_requests
    keys = [*HASHES, group_block_key(HASHES[2], 1)]
    assert so.kv_transfers.loads == [(TIER_REMOTE, key, b) for b, key in enumerate(keys)]
    lost = [(TIER_REMOTE, HASHES[1])]  # the buffer dropped one before the load
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [], [], kv_load_failed=lost))
    so = sched.schedule()  # no waiting again: it computes from the failed block's
    (new,) = so.new_requests
    assert new.num_computed_tokens == 0 and so.num_scheduled_tokens == {"c": 13}
    assert remote.load_failures == [0, 0, 1] and sched.kv.num_wait_timeouts == 0


@pytest.mark.e2e
def test_a_served_windowed_pair_answers_as_one_server(windowed, tmp_path):
    """A tiny Gemma 3's, then a tiny all-sliding Mistral's, prefill and decode servers behind
    the proxy: greedy completions equal the producer's own (asked unmarked), and the decode
    server took the prompts' blocks, every group's (a sliding group's: its window at the
    prompt's end), from the transfer (its remote hits grow by them)."""
    from disagg_pairs import PROMPTS, remote_hits, served_pair
    from served_answers import greedy
    from servers import free_port, wait_until

    with served_pair(windowed[0], tmp_path, free_port()) as (prefill, decode, proxy):
        answers = greedy(proxy.url, PROMPTS)
        assert wait_until(lambda: remote_hits(decode) > 0, 30), decode.log_tail()
        assert answers == greedy(prefill.url, PROMPTS)  # unmarked: the producer decodes them
