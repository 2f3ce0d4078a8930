"""Block manager as an executable spec: exact block ids, ref counts and eviction order."""

import pytest

from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.free_blocks import FreeBlockQueue, KVBlock
from zllm.kv.block_hash import hash_full_blocks

BS = 4


def make(num_blocks=10, caching=True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching)


def admit(bm: BlockManager, req_id: str, tokens: list[int], num_new: int | None = None) -> int:
    """Allocate like the scheduler does for a new request; returns cached token count."""
    cached = bm.find_cached_prefix(tokens)
    computed = cached.num_tokens
    num_new = len(tokens) - computed if num_new is None else num_new
    assert bm.allocate_slots(req_id, tokens, computed, num_new, cached)
    return computed


def test_free_queue_is_o1_linked_list():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    with pytest.raises(AssertionError):
        q.append(blocks[3])  # already free


def test_allocate_and_free_exact_ids_and_order():
    bm = make()
    assert admit(bm, "a", list(range(10))) == 0  # 10 tokens -> 3 blocks
    assert bm.block_ids("a") == [0, 1, 2]
    assert [bm.pool.blocks[i].ref_count for i in range(3)] == [1, 1, 1]
    assert bm.num_free_blocks == 7
    # Growing by 3 tokens (10 -> 13) needs a 4th block.
    assert bm.allocate_slots("a", list(range(13)), 10, 3)
    assert bm.block_ids("a") == [0, 1, 2, 3]
    bm.free("a")
    assert bm.num_free_blocks == 10
    # Uncached blocks go to the head (reused first); cached ones to the tail, tail-first.
    # Blocks 0,1,2 are full with hashes; block 3 holds one token and no hash.
    assert bm.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def test_allocation_failure_changes_nothing():
    bm = make(num_blocks=3)
    admit(bm, "a", list(range(8)))  # 2 blocks
    free_before = bm.pool.free_queue.block_ids()
    assert not bm.allocate_slots("b", list(range(100, 109)), 0, 9)  # needs 3
    assert bm.block_ids("b") == []
    assert bm.pool.free_queue.block_ids() == free_before


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = make()
    prompt = list(range(9))  # 2 full blocks + 1
    admit(bm, "a", prompt)
    assert bm.block_ids("a") == [0, 1, 2]
    # Same first 8 tokens, different tail: the two full blocks are shared.
    assert admit(bm, "b", prompt[:8] + [99, 98]) == 8
    assert bm.block_ids("b") == [0, 1, 3]
    assert [bm.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_never_all_tokens_cached():
    bm = make()
    admit(bm, "a", list(range(8)))
    bm.free("a")
    # An identical 8-token prompt may reuse only 1 block: the last token must be computed.
    assert admit(bm, "b", list(range(8))) == 4
    assert bm.block_ids("b") == [0, 2]


def test_cached_blocks_survive_free_and_are_revived_from_the_middle():
    bm = make(num_blocks=6)
    admit(bm, "a", list(range(9)))  # blocks 0,1 full+hashed, 2 partial
    bm.free("a")
    assert bm.pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert admit(bm, "b", list(range(8)) + [50]) == 8
    assert bm.block_ids("b") == [0, 1, 2]
    assert bm.pool.free_queue.block_ids() == [3, 4, 5]
    assert bm.prefix_cache_hits == 0  # only the scheduler records admitted lookups
    bm.record_prefix_query(9, 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 8)


def test_lru_eviction_order():
    bm = make(num_blocks=4)
    admit(bm, "a", list(range(5)))  # block 0 hashed (tokens 0..3), block 1 partial
    admit(bm, "b", list(range(100, 105)))  # block 2 hashed, block 3 partial
    bm.free("a")
    bm.free("b")
    # Head: the two unhashed partials, then a's hashed block (freed first), then b's.
    assert bm.pool.free_queue.block_ids() == [3, 1, 0, 2]
    h_a = hash_full_blocks(list(range(4)), BS)[0]
    h_b = hash_full_blocks(list(range(100, 104)), BS)[0]
    assert set(bm.pool.cached_blocks[0]) == {h_a, h_b}
    # 3 new blocks: takes 3, 1, then evicts 0 (a's prefix, least recently freed).
    admit(bm, "c", list(range(200, 212)))
    assert bm.block_ids("c") == [3, 1, 0]
    assert h_a not in bm.pool.cached_blocks[0] and h_b in bm.pool.cached_blocks[0]
    assert bm.find_cached_prefix(list(range(100, 105))).tables[0][0].block_id == 2


def test_evicted_cached_block_in_prefix_counts_against_free_space():
    bm = make(num_blocks=3)
    admit(bm, "a", list(range(9)))  # blocks 0,1 hashed, 2 partial
    bm.free("a")
    # A hit on 2 cached (free) blocks plus 1 new block needs all 3 free blocks.
    assert admit(bm, "b", list(range(8)) + [7]) == 8
    assert bm.num_free_blocks == 0


def test_no_prefix_caching():
    bm = make(caching=False)
    admit(bm, "a", list(range(9)))
    bm.free("a")
    assert admit(bm, "b", list(range(9))) == 0
    assert not bm.pool.cached_blocks[0]


def test_fork_and_copy_on_write():
    bm = make()
    prompt = list(range(6))  # block 0 full, block 1 holds 2 tokens
    admit(bm, "p", prompt)
    # The parent's prompt is computed; it sampled two tokens for two children.
    bm.fork("p", "c1")
    assert bm.block_ids("c1") == [0, 1]
    assert [bm.pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    # The child writes its first output token (position 6) into shared block 1: copy first.
    assert bm.allocate_slots("c1", prompt + [7], 6, 1)
    assert bm.block_ids("c1") == [0, 2]
    assert bm.take_pending_copies() == [(1, 2)]
    assert [bm.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    # The parent is now the only owner of block 1 and writes in place.
    assert bm.allocate_slots("p", prompt + [8], 6, 1)
    assert bm.block_ids("p") == [0, 1]
    assert bm.take_pending_copies() == []
    bm.free("p")
    bm.free("c1")
    assert bm.num_free_blocks == 10 and bm.num_referenced_blocks() == 0


def test_fork_on_block_boundary_needs_no_copy():
    bm = make()
    prompt = list(range(8))  # two full blocks
    admit(bm, "p", prompt)
    bm.fork("p", "c1")
    assert bm.allocate_slots("c1", prompt + [1], 8, 1)
    assert bm.block_ids("c1") == [0, 1, 2]
    assert bm.take_pending_copies() == []


def test_copy_on_write_fails_cleanly_without_free_block():
    bm = make(num_blocks=2)
    admit(bm, "p", list(range(6)))
    bm.fork("p", "c1")
    assert not bm.allocate_slots("c1", list(range(7)), 6, 1)
    assert bm.block_ids("c1") == [0, 1] and bm.take_pending_copies() == []


def test_usage():
    bm = make()
    admit(bm, "a", list(range(8)))
    assert bm.usage == pytest.approx(0.2)
    bm.free("a")
    assert bm.usage == 0.0  # cached blocks are free


def test_block_states_for_the_dashboard():
    bm = make(num_blocks=10)
    admit(bm, "a", list(range(9)))  # blocks 0,1 hashed and used, 2 used
    admit(bm, "b", list(range(100, 104)))  # block 3 used (hashed)
    bm.free("b")  # block 3: free but cached
    states, per_cell = bm.block_states()
    assert per_cell == 1 and states == bytes([1, 1, 1, 2, 0, 0, 0, 0, 0, 0])
    # Folded: 4 cells of 3 blocks (the last holds one); a cell shows its busiest block.
    states, per_cell = bm.block_states(max_cells=4)
    assert per_cell == 3 and states == bytes([1, 2, 0, 0])


# ---- KV cache groups: a full group and a sliding-window group share the pool ----------------


def make_hybrid(num_blocks=40, window=8) -> BlockManager:
    return BlockManager(num_blocks, BS, sliding_windows=[None, window])


def test_sliding_group_releases_blocks_outside_the_window():
    bm = make_hybrid(num_blocks=80, window=8)
    tokens = list(range(200))
    assert bm.allocate_slots("a", tokens[:5], 0, 5)
    for computed in range(5, 200):  # decode one token at a time
        assert bm.allocate_slots("a", tokens[: computed + 1], computed, 1)
        full, sliding = bm.group_block_ids("a")
        assert len(full) == len(sliding) == computed // BS + 1
        # The new token at `computed` sees positions computed-7..computed: at most
        # window/block_size + 1 blocks stay held; the rest are released (-1).
        held = [b for b in sliding if b != -1]
        first = max(0, computed - 8 + 1) // BS
        assert sliding[:first] == [-1] * first and -1 not in sliding[first:]
        assert len(held) <= 8 // BS + 1
        assert -1 not in full
    # At most W/bs + 1; at 199 the window 192..199 fills exactly blocks 48 and 49.
    assert bm.num_held_blocks("a", group=1) == 2
    assert bm.num_held_blocks("a", group=0) == 50
    bm.free("a")
    assert bm.num_free_blocks == 80 and bm.num_referenced_blocks() == 0


def test_released_blocks_go_back_to_the_pool_for_others():
    bm = make_hybrid(num_blocks=12, window=4)  # window of one block
    tokens = list(range(24))
    assert bm.allocate_slots("a", tokens[:16], 0, 16)  # 4 + 4 blocks
    assert bm.num_free_blocks == 4
    # Decoding from 16: the sliding group keeps only the blocks of positions 13..16.
    assert bm.allocate_slots("a", tokens[:17], 16, 1)
    assert bm.num_held_blocks("a", group=1) == 2 and bm.num_free_blocks == 4 + 3 - 2


def test_prefix_hit_must_hold_in_every_group():
    bm = make_hybrid(num_blocks=40, window=8)
    prompt = list(range(21))  # 5 full blocks + 1 token
    assert admit(bm, "a", prompt) == 0
    bm.free("a")
    hit = bm.find_cached_prefix(prompt)
    assert hit.num_tokens == 20
    full, sliding = hit.tables
    # The token at 20 sees 13..20: the sliding group needs blocks 3 and 4 only.
    assert len(full) == 5 and all(b is not None for b in full)
    assert sliding[:3] == [None, None, None] and all(b is not None for b in sliding[3:])
    assert admit(bm, "b", prompt) == 20
    assert bm.block_ids("b", 1)[:3] == [-1, -1, -1]
    assert bm.num_held_blocks("b", group=1) == 3  # blocks 3, 4 from the cache + 1 new


def test_prefix_hit_shrinks_to_what_the_sliding_group_still_caches():
    bm = make_hybrid(num_blocks=40, window=4)
    prompt = list(range(17))  # 4 full blocks + 1 token
    admit(bm, "a", prompt)
    # Decoding past the prompt releases the sliding group's early blocks into the free
    # queue (still cached); evict them by filling the pool with other work.
    bm.free("a")
    sliding_cache = bm.pool.cached_blocks[1]
    hashes = hash_full_blocks(prompt[:16], BS)
    victim = sliding_cache[hashes[3]]  # block 3's K/V for the sliding layers
    bm.pool.free_queue.remove(victim)
    bm.pool.free_queue.appendleft(victim)  # next to be evicted
    assert admit(bm, "filler", [999] * 3) == 0  # takes the head: evicts block 3's entry
    assert hashes[3] not in sliding_cache
    hit = bm.find_cached_prefix(prompt)
    # 16 cached tokens would need sliding block 3 (the token at 16 sees 13..16); with 12
    # cached, the token at 12 sees 9..12, so only block 2 must be cached (12 is computed anew).
    assert hit.num_tokens == 12
    assert [b is None for b in hit.tables[1]] == [True, True, False]


def test_fork_shares_every_group_and_copies_on_write():
    bm = make_hybrid(num_blocks=40, window=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    admit(bm, "p", prompt)
    bm.fork("p", "c")
    assert bm.group_block_ids("c") == bm.group_block_ids("p")
    assert bm.allocate_slots("c", prompt + [1], 10, 1)
    copies = bm.take_pending_copies()
    assert len(copies) == 2  # the shared partial block in each group
    full_p, sliding_p = bm.group_block_ids("p")
    full_c, sliding_c = bm.group_block_ids("c")
    assert full_c[2] != full_p[2] and sliding_c[2] != sliding_p[2]
    assert sliding_c[:1] == [-1]  # the token at 10 sees 7..10: block 0 released
    bm.free("p")
    bm.free("c")
    assert bm.num_referenced_blocks() == 0


def test_blocks_needed_bounds_the_longest_context():
    bm = make_hybrid(num_blocks=40, window=8)
    # 100 tokens in chunks of 16: full 25 blocks; sliding holds the window and a chunk,
    # (8 - 1 + 16) / 4 rounded up + 1 = 7 blocks at most.
    assert bm.blocks_needed(100, 16) == 25 + 7
    assert bm.blocks_needed(8, 16) == 2 + 2
    assert make().blocks_needed(100, 16) == 25
