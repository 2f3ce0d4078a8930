"""KV offload: the tiers below the KV pool (CPU memory, local disk) and their connector.

The core's side as an executable spec (exact hashes, block ids, LRU order, transfers), the
executor's side on real tensors and files (round trips, corruption, bounds, the directory
lock), then the engine: a prefix evicted from the pool comes back from each tier with the
outputs of recomputing it, a corrupt disk block is recomputed, the bounds hold, and a
restarted engine finds its disk tier again.
"""

from __future__ import annotations

import logging
import os
import random
import re
import stat
from pathlib import Path

import pytest
import torch
from kv_tiers import (
    GREEDY,
    POOL_BYTES,
    assert_same_outputs,
    damage_a_disk_block,
    flush_pool,
    make_pool,
    random_prompt,
    tiered_connector,
)
from scheduler_parts import BS

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.config.kv_layout import tier_directory
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TierIndex
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.executor.kv.connector import CpuTier, DiskTier, KVPool
from zllm.kv.block_hash import group_block_key, hash_full_blocks
from zllm.kv.tier_key import read_key, resolve_key_file
from zllm.kv.tiers import (
    TIER_CPU,
    TIER_DISK,
    block_file_name,
    existing_disk_blocks,
    parse_block_file_name,
)
from zllm.protocol import ModelRunnerOutput


# ---- the core's index --------------------------------------------------------------------------
def test_tier_index_lookup_is_the_leading_run_and_lru_evicts_oldest_unprotected():
    index = TierIndex(TIER_CPU, capacity_blocks=3)
    assert index.add(10, set()) == [] and index.add(11, set()) == [] and index.add(12, set()) == []
    assert index.lookup([10, 11, 12, 13]) == 3 and index.lookup([11, 10]) == 2
    assert index.lookup([13, 10]) == 0
    index.touch(10)  # 10 is now the newest: 11 goes first
    assert index.add(13, set()) == [11]
    assert index.add(14, protected={12}) == [10]  # 12 is being loaded this step
    assert sorted([h for h in (10, 11, 12, 13, 14) if h in index]) == [12, 13, 14]


def test_evictions_are_stored_in_every_tier_and_lru_beyond_the_bound_is_dropped():
    kv = tiered_connector(cpu_blocks=2, disk_blocks=3)
    kv.evicted([(1, 7), (2, 8)])
    t = kv.take_transfers()
    assert t.stores == [(TIER_CPU, 1, 7), (TIER_DISK, 1, 7), (TIER_CPU, 2, 8), (TIER_DISK, 2, 8)]
    assert t.drops == [] and t.loads == []
    kv.evicted([(3, 9)])  # the cpu tier is full: its oldest (1) goes, the disk keeps it
    t = kv.take_transfers()
    assert t.drops == [(TIER_CPU, 1)]
    assert t.stores == [(TIER_CPU, 3, 9), (TIER_DISK, 3, 9)]
    assert kv.lookup([1, 2, 3, 4]) == [TIER_DISK, TIER_CPU, TIER_CPU]  # cpu preferred
    assert kv.take_transfers() is None  # nothing happened since


def test_a_block_stored_and_evicted_in_one_step_is_never_sent():
    kv = tiered_connector(cpu_blocks=1)
    kv.evicted([(1, 7), (2, 8)])  # 2 pushes 1 out before the executor ever held it
    t = kv.take_transfers()
    assert t.stores == [(TIER_CPU, 2, 8)] and t.drops == []


def test_blocks_loaded_in_a_step_are_not_evicted_in_it():
    kv = tiered_connector(cpu_blocks=2)
    kv.evicted([(1, 7), (2, 8)])
    kv.take_transfers()
    kv.load([1, 2], [30, 31], [TIER_CPU, TIER_CPU])
    kv.evicted([(3, 9)])  # no room without dropping a block being loaded: 3 is not kept
    t = kv.take_transfers()
    assert t.loads == [(TIER_CPU, 1, 30), (TIER_CPU, 2, 31)]
    assert t.stores == [] and t.drops == []
    assert kv.lookup([1, 2, 3]) == [TIER_CPU, TIER_CPU]


def test_a_failed_load_forgets_that_copy_and_counts():
    kv = tiered_connector(disk_blocks=4, on_disk=[5, 6])
    assert kv.lookup([5, 6]) == [TIER_DISK, TIER_DISK]  # what the directory held at start
    kv.load_failed([(TIER_DISK, 6)])
    assert kv.lookup([5, 6]) == [TIER_DISK]
    assert kv.take_transfers().drops == [(TIER_DISK, 6)]
    assert kv.load_failures == [0, 1, 0]  # (cpu, disk, remote)


def test_a_directory_over_its_bound_is_trimmed_oldest_first():
    kv = tiered_connector(disk_blocks=2, on_disk=[1, 2, 3])
    assert kv.take_transfers().drops == [(TIER_DISK, 1)]


# ---- the block manager: evictions, candidate hashes, pins ----------------------------------------
def admit(bm: BlockManager, req_id: str, tokens: list[int]) -> None:
    hit = bm.find_cached_prefix(tokens)
    assert bm.allocate_slots(req_id, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit)


def test_evictions_are_recorded_with_their_hash_and_block():
    bm = BlockManager(4, BS, record_evictions=True)
    admit(bm, "a", list(range(9)))  # blocks 0, 1 full (hashed), 2 partial
    bm.free("a")
    hashes = hash_full_blocks(list(range(8)), BS)
    assert bm.take_evicted() == []
    admit(bm, "b", list(range(100, 113)))  # 4 blocks: the free one, then 1 and 0 (tail first)
    assert bm.take_evicted() == [(hashes[1], 1), (hashes[0], 0)]
    assert bm.take_evicted() == []


def test_candidate_hashes_cover_every_full_block_but_the_last_token():
    bm = BlockManager(8, BS)
    hit = bm.find_cached_prefix(list(range(13)))  # 3 full blocks; 12 tokens may be cached
    assert hit.num_blocks == 0 and hit.candidate_hashes == hash_full_blocks(list(range(12)), BS)
    assert len(bm.find_cached_prefix(list(range(12))).candidate_hashes) == 2  # not the last


def test_pins_hold_blocks_until_their_time_then_free_them():
    bm = BlockManager(6, BS, max_pinned_blocks=2)
    admit(bm, "a", list(range(13)))  # blocks 0-3, three full
    assert bm.pin("a", num_tokens=12, until=100.0) == 2  # the bound: the leading two
    assert [bm.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.free("a")
    assert bm.num_free_blocks == 4  # 0 and 1 stay pinned, out of the free queue
    assert bm.pin("a", 12, 200.0) == 0  # a request no longer holding blocks pins nothing
    bm.unpin_expired(now=99.0)
    assert len(bm.pins) == 2
    bm.unpin_expired(now=100.0)
    assert len(bm.pins) == 0 and bm.num_free_blocks == 6
    assert bm.find_cached_prefix(list(range(13))).num_blocks == 3  # still cached, just free


def test_pinning_again_extends_and_release_frees_all():
    bm = BlockManager(6, BS, max_pinned_blocks=4)
    admit(bm, "a", list(range(9)))
    bm.pin("a", 8, until=10.0)
    admit(bm, "b", list(range(9)))  # a prefix hit on the pinned blocks
    assert bm.pin("b", 8, until=50.0) == 2
    assert bm.pool.blocks[0].ref_count == 3  # a, b, and one pin (not two)
    bm.free("a")
    bm.free("b")
    bm.unpin_expired(now=20.0)
    assert len(bm.pins) == 2  # extended to 50
    bm.release_pins()
    assert len(bm.pins) == 0 and bm.num_free_blocks == 6


def test_blocks_of_a_request_never_computed_stop_being_cached():
    bm = BlockManager(6, BS)
    admit(bm, "a", list(range(9)))
    bm.free("a", keep_hashes=False)
    assert bm.find_cached_prefix(list(range(9))).num_blocks == 0


def test_several_groups_take_each_block_from_the_pool_or_a_tier():
    """A hybrid cache (a full group and a sliding one, window 4: it needs a prefix's last
    block only): the blocks of a prefix are spread over the pool and a tier, group by
    group; the hit takes each from where it is and loads the rest into fresh blocks, which
    become cached; evictions name each group's copy apart (group_block_key)."""
    bm = BlockManager(12, BS, sliding_windows=(None, 4), record_evictions=True)
    tokens = list(range(13))  # 3 full blocks
    hashes = hash_full_blocks(tokens[:12], BS)
    assert bm.allocate_slots("a", tokens, 0, 8, bm.find_cached_prefix(tokens))
    assert bm.allocate_slots("a", tokens, 8, 5)  # the sliding group lets block 0 go
    assert bm.group_block_ids("a") == [[0, 1, 4, 5], [-1, 3, 6, 7]]
    bm.free("a")
    admit(bm, "b", list(range(100, 113)))  # evicts the sliding group's 0, the full group's 2
    evicted = bm.take_evicted()
    assert evicted == [(group_block_key(hashes[0], 1), 2), (hashes[2], 4)]
    assert group_block_key(hashes[0], 0) == hashes[0]  # group 0: the hash itself
    in_tier = {key for key, _ in evicted}
    hit = bm.find_cached_prefix(tokens, tier_of=lambda key: TIER_CPU if key in in_tier else None)
    assert hit.num_blocks == 3
    tables = [[b and b.block_id for b in table] for table in hit.tables]
    assert tables == [[0, 1, None], [None, None, 6]]
    assert hit.loads == [(0, 2, TIER_CPU)] and hit.num_loaded_blocks == 1
    bm.free("b")
    assert bm.allocate_slots("c", tokens, 12, 1, hit)
    assert bm.group_block_ids("c") == [[0, 1, 4, 9], [-1, -1, 6, 3]]
    assert bm.pool.cached_blocks[0][hashes[2]].block_id == 4  # the loaded block is a prefix now
    assert bm.take_evicted() == [(group_block_key(hashes[1], 1), 3)]
    # Without the tiers: the full group holds blocks 0 and 1, but the sliding group's
    # window for k = 2 is its block 1, just evicted, and for k = 1 its block 0: no hit.
    assert bm.find_cached_prefix(tokens[:9], tier_of=lambda key: None).num_blocks == 0


# ---- the scheduler: loads at admission ---------------------------------------------------------
def test_a_request_whose_prefix_left_the_pool_loads_it_from_the_tier():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    bm = BlockManager(6, BS, record_evictions=True)
    kv = tiered_connector(cpu_blocks=8)
    sched = Scheduler(config, bm, kv_connector=kv)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    hashes = hash_full_blocks(prompt[:12], BS)

    def run_one(req_id: str, tokens: list[int]) -> None:
        sched.add_request(Request(req_id, tokens, params))
        so = sched.schedule()
        sched.update_from_output(so, ModelRunnerOutput(so.step_id, [req_id], [[1]]))
        return so

    run_one("a", prompt)
    so = run_one("b", list(range(200, 221)))  # 21 tokens, 6 blocks: evicts all of a's
    assert sorted(h for _, h, _ in so.kv_transfers.stores) == sorted(hashes)
    so = run_one("c", prompt)
    assert so.new_requests[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"c": 1}  # only the last token is computed
    loads = so.kv_transfers.loads
    assert [h for _, h, _ in loads] == hashes
    assert [b for _, _, b in loads] == so.new_requests[0].block_ids[0][:3]
    assert kv.hit_tokens[TIER_CPU] == 12 and bm.prefix_cache_hits == 0


# ---- the executor's tiers on real tensors and files ------------------------------------------------
def block_of(pool: KVPool, block_id: int) -> torch.Tensor:
    return torch.stack([kv[:, block_id] for kv in pool.tensors])


def test_pool_gather_and_scatter_move_whole_blocks():
    pool = make_pool()
    data = pool.gather([5, 2])
    assert data.shape == (2, 3, 2, BS, 2, 8)
    assert torch.equal(data[0], block_of(pool, 5)) and torch.equal(data[1], block_of(pool, 2))
    pool.scatter([0, 1], data)
    assert torch.equal(block_of(pool, 0), block_of(pool, 5))
    assert torch.equal(block_of(pool, 1), block_of(pool, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cpu_tier_round_trip_and_slots(dtype):
    pool = make_pool(dtype=dtype)
    tier = CpuTier(pool, capacity=2, pin_memory=False)
    expected = [block_of(pool, 3).clone(), block_of(pool, 4).clone()]
    tier.store([30, 40], [3, 4])
    with pytest.raises(RuntimeError, match="more blocks than it holds"):
        tier.store([50], [5])
    assert tier.load([40, 99, 30], [0, 1, 2]) == [1]  # 99 was never stored
    assert torch.equal(block_of(pool, 0), expected[1]) and torch.equal(
        block_of(pool, 2), expected[0]
    )
    tier.drop([30])
    tier.store([50], [5])  # its slot is free again
    assert tier.load([30], [6]) == [0]


def key(n: int) -> bytes:
    """A 16-byte block key for the tests that name blocks by hand (as wide as the engine's)."""
    return n.to_bytes(16, "little", signed=True)


TIER_KEY = bytes(range(32))  # a disk tier's key in the tests that make one directly


def disk_tier(tmp_path: Path, pool: KVPool) -> DiskTier:
    nbytes = pool.tensors[0][:, 0].numel() * len(pool.tensors) * pool.tensors[0].element_size()
    return DiskTier(pool, tmp_path / "tier", nbytes, TIER_KEY)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_disk_tier_round_trip_from_memory_then_from_file(tmp_path, dtype):
    pool = make_pool(dtype=dtype)
    tier = disk_tier(tmp_path, pool)
    expected = block_of(pool, 6).clone()
    tier.store([key(-123456789)], [6])
    assert tier.load([key(-123456789)], [0]) == []  # served while (or after) it is written
    tier.flush()
    assert (tmp_path / "tier" / block_file_name(key(-123456789))).is_file()
    assert existing_disk_blocks(tmp_path / "tier") == [key(-123456789)]
    pool.tensors[0].zero_()
    assert tier.load([key(-123456789)], [1]) == []
    assert torch.equal(block_of(pool, 1)[1:], expected[1:])  # layer 0 was zeroed after
    tier.drop([key(-123456789)])
    tier.flush()
    assert existing_disk_blocks(tmp_path / "tier") == []
    assert tier.load([key(-123456789)], [1]) == [0]


def test_a_disk_slower_than_the_evictions_holds_at_most_its_bound_in_memory(tmp_path):
    """While the writer is stuck, blocks past `max_pending` are not stored (a later load
    misses them: recomputed) rather than queued in memory without bound (issue 56); once the
    disk catches up, stores go on."""
    import threading

    pool = make_pool()
    nbytes = pool.tensors[0][:, 0].numel() * len(pool.tensors) * pool.tensors[0].element_size()
    tier = DiskTier(pool, tmp_path / "tier", nbytes, TIER_KEY, max_pending_bytes=2 * nbytes)
    stuck, write = threading.Event(), tier._write
    tier._write = lambda block_hash, block: (stuck.wait(10), write(block_hash, block))
    tier.store([key(1), key(2), key(3)], [1, 2, 3])
    tier.store([key(4)], [4])
    assert sorted(tier._pending) == [key(1), key(2)]
    assert tier.load([key(1), key(3), key(4)], [5, 6, 7]) == [1, 2]  # 3 and 4: not stored
    stuck.set()
    tier.flush()
    assert existing_disk_blocks(tmp_path / "tier") == sorted([key(1), key(2)])
    tier.store([key(3)], [3])
    tier.flush()
    assert key(3) in existing_disk_blocks(tmp_path / "tier")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "other-hash"])
def test_disk_tier_refuses_a_damaged_block(tmp_path, damage):
    pool = make_pool()
    tier = disk_tier(tmp_path, pool)
    tier.store([key(7), key(8)], [1, 2])
    tier.flush()
    path = tmp_path / "tier" / block_file_name(key(7))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "delete":
        path.unlink()
    else:  # a file renamed over another block's name
        path.write_bytes((tmp_path / "tier" / block_file_name(key(8))).read_bytes())
    before = block_of(pool, 0).clone()
    assert tier.load([key(7), key(8)], [0, 3]) == [0]
    assert torch.equal(block_of(pool, 0), before)  # nothing written for the bad block
    assert torch.equal(block_of(pool, 3), block_of(pool, 2))


def test_disk_tier_directory_is_one_engines(tmp_path):
    pool = make_pool()
    first = disk_tier(tmp_path, pool)
    first.store([key(1)], [1])
    first.flush()
    with pytest.raises(RuntimeError, match="another engine uses"):
        disk_tier(tmp_path, pool)
    first._lock_file.close()  # as when its process ends
    again = disk_tier(tmp_path, pool)  # the next engine keeps what the first stored
    assert existing_disk_blocks(again.directory) == [key(1)]


def test_block_file_names_round_trip_keys():
    for value in (bytes(16), b"\xff" * 16, key(-1), *hash_full_blocks(list(range(8)), 4)):
        assert parse_block_file_name(block_file_name(value)) == value
    assert block_file_name(key(1)) == "01" + "00" * 15 + ".zkv"  # 32 hex digits, byte order
    assert parse_block_file_name("nothex" + "0" * 26 + ".zkv") is None
    assert parse_block_file_name("0" * 16 + ".zkv") is None  # a 64-bit key's (format 3) name
    assert parse_block_file_name(".lock") is None


# ---- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recomputed(tiny_llama_dir):
    """What recomputing gives: the prompts on an engine without tiers."""
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES)
    rng = random.Random(1)
    prompts = [random_prompt(rng, 250), random_prompt(rng, 90)]
    return prompts, llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_an_evicted_prefix_comes_back_from_the_tier(tiny_llama_dir, tmp_path, recomputed, tier):
    prompts, reference = recomputed
    extra = (
        dict(kv_offload_bytes=1 << 20)
        if tier == "cpu"
        else dict(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    )
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, **extra)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    flush_pool(llm, random.Random(2))
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.heartbeat()
    index = TIER_CPU if tier == "cpu" else TIER_DISK
    assert again[0].num_cached_tokens == 240 and again[1].num_cached_tokens == 80
    assert stats.kv_tiers.hits[index] == 320 and stats.prefix_cache.hits == 0
    for ours, ref, before in zip(again, reference, first, strict=True):
        assert_same_outputs(ours, ref)
        assert_same_outputs(before, ref)
    # The bounds: 1 MiB is 128 blocks of 8 KiB.
    assert stats.kv_tiers.capacity[index] == 128
    assert 0 < stats.kv_tiers.blocks[index] <= 128
    if tier == "disk":
        llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
        files = existing_disk_blocks(tier_directory(llm.config))
        assert len(files) == stats.kv_tiers.blocks[index]


def test_disk_tier_bound_holds_and_its_files_follow(tiny_llama_dir, tmp_path):
    llm = LLM(
        tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, kv_offload_dir=str(tmp_path),
        kv_offload_disk_bytes=20 * 8192,
    )  # fmt: skip
    flush_pool(llm, random.Random(3))
    flush_pool(llm, random.Random(4))
    stats = llm.engine.heartbeat()
    assert stats.kv_tiers.stores[TIER_DISK] > 20 and stats.kv_tiers.blocks[TIER_DISK] == 20
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    assert len(existing_disk_blocks(tier_directory(llm.config))) == 20


@pytest.mark.parametrize("forged", [False, True], ids=["damaged", "forged"])
def test_a_corrupt_disk_block_is_recomputed(tiny_llama_dir, tmp_path, recomputed, forged):
    """A flipped bit, or an edit whose MAC is recomputed under another key (where a CRC
    would have been recomputed to match): the load fails, the file is removed, the block is
    recomputed and the output is the same."""
    prompts, reference = recomputed
    llm = LLM(
        tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_disk_bytes=1 << 20, kv_offload_key_file=str(tmp_path / "key"),
    )  # fmt: skip
    victim = damage_a_disk_block(llm, prompts[0], forge_key=bytes(32) if forged else None)
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert_same_outputs(again, reference[0])
    stats = llm.engine.heartbeat()
    assert stats.kv_tiers.load_failures[TIER_DISK] == 1
    assert stats.kv_tiers.hits[TIER_DISK] == 240  # the loads were planned; one recomputed
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    assert not victim.exists()  # the core forgot it and the executor deleted it


def test_a_restarted_engine_finds_its_disk_tier(tiny_llama_dir, tmp_path, recomputed):
    prompts, reference = recomputed
    kw = dict(kv_cache_memory_bytes=POOL_BYTES, kv_offload_dir=str(tmp_path))
    llm = LLM(tiny_llama_dir, **kw)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    flush_pool(llm, random.Random(2))
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    llm.model_runner.kv_tiers.tiers[TIER_DISK]._lock_file.close()  # as when it exits
    del llm
    restarted = LLM(tiny_llama_dir, **kw)
    out = restarted.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 240
    assert restarted.engine.heartbeat().kv_tiers.hits[TIER_DISK] == 240
    assert_same_outputs(out, reference[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), "needs prefix caching"),
        (dict(kv_offload_bytes=100), "holds no KV block"),
    ],
)  # fmt: skip
def test_offload_refuses_what_it_cannot_keep(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, **kwargs)


# ---- served ----------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "tp2"])
def test_served_tiers_show_in_metrics_and_dashboard(tiny_llama_dir, engine_pool, tmp_path, ranks):
    """Both tiers' hits, capacity and stores in /metrics and the dashboard; with two
    tensor-parallel ranks too (each rank's pool, sized per rank, holds its KV head of every
    block: half the bytes for the same blocks; the tiers' sizes are the whole blocks', each
    rank keeping its part)."""
    from servers import metric, wait_until

    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "serve.log", "--served-model-name", "tiny",
        "--tensor-parallel-size", str(ranks), "--kv-cache-memory-bytes", str(POOL_BYTES // ranks),
        "--kv-offload-bytes", "512K",
        "--kv-offload-dir", str(tmp_path / "tier"), "--kv-offload-disk-bytes", "1M",
    ) as server:  # fmt: skip
        rng = random.Random(7)
        first = random_prompt(rng, 250)["prompt_token_ids"]

        def complete(tokens: list[int]) -> dict:
            r = server.post("/v1/completions", {"model": "tiny", "prompt": tokens,
                                                "max_tokens": 4, "temperature": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        before = complete(first)
        for _ in range(6):
            complete(random_prompt(rng, 300)["prompt_token_ids"])
        again = complete(first)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 240
        assert again["choices"][0]["text"] == before["choices"][0]["text"]

        def series(name: str, tier: str) -> float:
            line = rf'^{name}{{engine="0",model_name="tiny",tier="{tier}"}} (\S+)$'
            match = re.search(line, server.get("/metrics").text, re.M)
            assert match, f"{name} {tier} missing from /metrics"
            return float(match.group(1))

        hits = "zllm:kv_offload_hits_total"
        assert wait_until(lambda: series(hits, "cpu") + series(hits, "disk") == 240, timeout=10)
        assert series("zllm:kv_offload_capacity_blocks", "cpu") == 64
        assert series("zllm:kv_offload_capacity_blocks", "disk") == 128
        assert metric(server.get("/metrics").text, "zllm:kv_offload_stored_blocks_total") > 0
        tiers = server.get("/dashboard/stats").json()["engine"]["kv_tiers"]
        assert [t["name"] for t in tiers] == ["cpu", "disk"]
        assert sum(t["hits"] for t in tiers) == 240


def test_sleep_keeps_the_prefix_cache_in_the_tier(tiny_llama_dir, recomputed):
    """Sleep mode empties the pool; with a tier its cached prefixes are stored first, so
    after waking they load instead of being recomputed."""
    prompts, reference = recomputed
    llm = LLM(
        tiny_llama_dir, kv_cache_memory_bytes=POOL_BYTES, kv_offload_bytes=1 << 20,
        enable_sleep_mode=True,
    )  # fmt: skip
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.heartbeat().kv_tiers.stores[TIER_CPU] == 0  # nothing evicted yet
    llm.sleep()
    llm.wake_up()
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [240, 80]
    assert llm.engine.heartbeat().kv_tiers.hits[TIER_CPU] == 320
    for ours, ref in zip(again, reference, strict=True):
        assert_same_outputs(ours, ref)


def test_the_disk_tier_key_is_made_once_owner_only_and_outside_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "cache"))
    path = resolve_key_file(str(tmp_path / "kv"), None)  # the default: made at first start
    assert path == str((tmp_path / "cache" / "kv-offload.key").resolve())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    key = read_key(path)
    assert len(key) == 32 and resolve_key_file(str(tmp_path / "kv"), None) == path
    assert read_key(path) == key  # kept: a restarted engine reads its files again
    with pytest.raises(ValueError, match="inside --kv-offload-dir"):
        resolve_key_file(str(tmp_path / "kv"), str(tmp_path / "kv" / "sub" / "key"))
    short = tmp_path / "short.key"
    short.write_bytes(b"0123")
    with pytest.raises(ValueError, match="at least 32"):
        resolve_key_file(str(tmp_path / "kv"), str(short))


def test_a_disk_tier_key_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    shared = tmp_path / "shared.key"
    shared.write_bytes(os.urandom(32))
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert resolve_key_file(str(tmp_path / "kv"), str(shared)) == str(shared.resolve())
    assert any("readable by others" in r.getMessage() for r in caplog.records)


def test_blocks_written_under_another_key_are_removed_not_loaded(tmp_path):
    """A restart with another key (or files another engine's key signed): each load fails
    its check and the file is removed, so nothing unauthenticated reaches the pool."""
    pool = make_pool()
    tier = DiskTier(pool, tmp_path / "tier", pool.block_nbytes, TIER_KEY)
    tier.store([key(5), key(6)], [1, 2])
    tier.flush()
    tier._lock_file.close()  # as when its engine exits
    other = DiskTier(pool, tmp_path / "tier", pool.block_nbytes, bytes(32))
    for kv in pool.tensors:
        kv[:, 3:5] = 0
    assert other.load([key(5), key(6)], [3, 4]) == [0, 1]
    assert existing_disk_blocks(tmp_path / "tier") == []  # removed, never loaded
    assert not block_of(pool, 3).any() and not block_of(pool, 4).any()
