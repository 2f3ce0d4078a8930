"""The KV block pool on its own: exact block ids in the free queue, reference counts, the
hash index with lazy eviction, the evicted records for the KV tiers, pins and resets."""

import pytest

from zllm.core.kv.block_pool import BlockPool
from zllm.kv.block_hash import BlockHash, group_block_key

H0, H1, H2 = BlockHash(b"h0"), BlockHash(b"h1"), BlockHash(b"h2")


def take_cached(pool: BlockPool, hashes: list[BlockHash], group: int = 0) -> list[int]:
    """Take a fresh block per hash and cache it there, as a request filling full blocks."""
    ids = []
    for block_hash in hashes:
        block = pool.take_free()
        pool.cache(block, block_hash, group)
        ids.append(block.block_id)
    return ids


def test_fresh_blocks_come_in_id_order_and_unreferenced_ones_go_back_to_the_head():
    pool = BlockPool(4)
    assert [pool.take_free().block_id for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.unref(pool.blocks[1])  # holds nothing reusable: handed out first
    assert pool.free_queue.block_ids() == [1, 3]
    assert pool.take_free().block_id == 1
    pool.take_free()
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        pool.take_free()


def test_a_cached_block_goes_to_the_tail_and_is_evicted_last():
    pool = BlockPool(4)
    (cached,) = take_cached(pool, [H0])
    plain = pool.take_free().block_id
    pool.unref(pool.blocks[cached])
    pool.unref(pool.blocks[plain])
    assert pool.free_queue.block_ids() == [plain, 2, 3, cached]
    assert pool.lookup(0, H0) is pool.blocks[cached]  # free, still a cached prefix


def test_take_revives_a_cached_block_from_the_middle_of_the_free_queue():
    pool = BlockPool(5)
    ids = take_cached(pool, [H0, H1, H2])
    for block_id in ids:
        pool.unref(pool.blocks[block_id])
    assert pool.free_queue.block_ids() == [3, 4, 0, 1, 2]
    revived = pool.lookup(0, H1)
    assert revived is not None
    pool.take(revived)
    assert revived.ref_count == 1 and pool.free_queue.block_ids() == [3, 4, 0, 2]
    pool.take(revived)  # a second holder: no free-queue change
    assert revived.ref_count == 2 and pool.num_free_blocks == 4
    pool.unref(revived)
    assert pool.num_free_blocks == 4  # one holder left
    pool.unref(revived)
    assert pool.free_queue.block_ids() == [3, 4, 0, 2, 1]


def test_lazy_eviction_drops_the_hash_only_when_the_block_is_reused():
    pool = BlockPool(2, record_evictions=True)
    ids = take_cached(pool, [H0, H1])
    for block_id in reversed(ids):
        pool.unref(pool.blocks[block_id])
    assert pool.take_evicted() == []  # freed, not evicted
    reused = pool.take_free()
    assert reused.block_id == 1 and reused.block_hash is None and reused.ref_count == 1
    assert pool.lookup(0, H1) is None and pool.lookup(0, H0) is pool.blocks[0]
    assert pool.take_evicted() == [(group_block_key(H1, 0), 1)]
    assert pool.take_evicted() == []  # taken once


def test_evictions_are_kept_only_when_asked_and_name_the_group():
    quiet = BlockPool(1)
    take_cached(quiet, [H0])
    quiet.unref(quiet.blocks[0])
    quiet.take_free()
    assert quiet.take_evicted() == []
    pool = BlockPool(1, num_groups=2, record_evictions=True)
    take_cached(pool, [H0], group=1)
    pool.unref(pool.blocks[0])
    pool.take_free()
    assert pool.take_evicted() == [(group_block_key(H0, 1), 0)]
    assert group_block_key(H0, 1) != group_block_key(H0, 0)


def test_ref_counts_guard_against_double_free_and_double_cache():
    pool = BlockPool(2)
    block = pool.take_free()
    pool.unref(block)
    with pytest.raises(AssertionError):
        pool.unref(block)
    block = pool.take_free()
    pool.cache(block, H0, 0)
    with pytest.raises(AssertionError):
        pool.cache(block, H1, 0)


def test_uncache_keeps_another_blocks_entry_for_the_same_hash():
    pool = BlockPool(3)
    first, second = pool.take_free(), pool.take_free()
    pool.cache(first, H0, 0)
    pool.cache(second, H0, 0)  # a later copy takes the index entry
    pool.uncache(first)
    assert first.block_hash is None and pool.lookup(0, H0) is second
    pool.uncache(second)
    assert pool.lookup(0, H0) is None


def test_evict_cached_uncaches_free_blocks_least_recently_used_first():
    pool = BlockPool(4)
    ids = take_cached(pool, [H0, H1, H2])
    pool.unref(pool.blocks[ids[2]])
    pool.unref(pool.blocks[ids[0]])  # ids[1] stays in use
    assert pool.evict_cached() == [(group_block_key(H2, 0), 2), (group_block_key(H0, 0), 0)]
    assert pool.lookup(0, H0) is None and pool.lookup(0, H2) is None
    assert pool.lookup(0, H1) is pool.blocks[1]  # in use: still cached
    assert pool.free_queue.block_ids() == [3, 2, 0]  # where they were, just uncached


def test_pins_hold_a_reference_until_their_time_then_drop_cached_releases_the_rest():
    pool = BlockPool(4, max_pinned_blocks=2)
    ids = take_cached(pool, [H0, H1, H2])
    assert pool.pin(pool.blocks[ids[0]], until=10.0)
    assert pool.pin(pool.blocks[ids[1]], until=20.0)
    assert not pool.pin(pool.blocks[ids[2]], until=30.0)  # the bound
    for block_id in ids:
        pool.unref(pool.blocks[block_id])
    assert pool.free_queue.block_ids() == [3, 2]  # the pinned two stay out
    pool.unpin_expired(now=10.0)
    assert len(pool.pins) == 1 and pool.free_queue.block_ids() == [3, 2, 0]
    assert pool.drop_cached() == 3  # the last pin released, then every cached free block
    assert len(pool.pins) == 0 and pool.num_free_blocks == 4
    assert all(pool.lookup(0, h) is None for h in (H0, H1, H2))


def test_reset_forgets_every_hash_and_reports_a_clear_to_kv_events():
    pool = BlockPool(3, num_groups=2, kv_event_group=1, max_pinned_blocks=1)
    pool.record_kv_events()
    take_cached(pool, [H0], group=0)  # not the event group: not reported
    (pinned,) = take_cached(pool, [H1], group=1)
    assert pool.take_kv_events() == ([H1], [], False)
    pool.pin(pool.blocks[pinned], until=1e12)
    pool.unref(pool.blocks[0])
    pool.unref(pool.blocks[pinned])
    pool.reset_prefix_cache()  # releases the pin
    assert pool.num_free_blocks == 3 and len(pool.pins) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.lookup(0, H0) is None and pool.lookup(1, H1) is None
    assert pool.take_kv_events() == ([], [], True)
    assert pool.take_kv_events() == ([], [], False)


def test_reset_with_a_block_in_use_is_a_bug():
    pool = BlockPool(2)
    pool.take_free()
    with pytest.raises(AssertionError, match="blocks in use"):
        pool.reset_prefix_cache()


def test_block_states_show_free_in_use_and_cached_cells():
    pool = BlockPool(6)
    take_cached(pool, [H0])  # block 0: in use
    (cached,) = take_cached(pool, [H1])
    pool.unref(pool.blocks[cached])  # block 1: free but cached
    assert pool.block_states() == (bytes([1, 2, 0, 0, 0, 0]), 1)
    assert pool.block_states(max_cells=3) == (bytes([1, 0, 0]), 2)  # in use wins its cell
    assert pool.num_referenced_blocks() == 1
