"""The KV block manager: who owns which cache block, and which blocks hold a known prefix.

The executor's KV pool is `num_blocks` fixed-size blocks. This module decides which block ids
each request's tokens live in; it never sees tensor data. Plain Python, no torch.

A request's block table maps its token positions to blocks::

    positions  0..15      16..31     32..40 (partial)
    blocks    [ 7 ]      [ 3 ]      [ 12 ]
    hashes    h0=H(-,t0..15)  h1=H(h0,t16..31)   (none: not full yet)

Full blocks are identified by a hash chain over their tokens (the parent's hash, then the
block's token ids), so two requests with the same first k*block_size tokens share the same k
blocks (automatic prefix caching). The blocks themselves, their reference counts, the free
queue and the index of cached blocks are the pool's (core/kv/block_pool.py): a block a request
frees stays cached there until it is reused (lazy eviction), so a later request with that
prefix takes it back. This module keeps what the pool must not know: which request holds
which blocks.

`n > 1` requests fork: children share the parent's blocks (ref counts up). A shared block that
is about to be written (the partial last block) is copied first (copy-on-write); the copies a
step needs are returned by `take_pending_copies` and carried out by the executor.

KV cache groups (zllm/kv/cache_groups.py): a request holds one block table per group, all
drawn from the one pool. A sliding-window group releases blocks that fell out of the window
of the step's first new token (None in the table, -1 on the wire), so a long sequence holds
about window/block_size + 1 blocks there. A prefix hit of k blocks must hold in every group:
a full group needs blocks 0..k-1 cached, a sliding group only the ones inside the window of
position k * block_size.

A hybrid model's state layers (zllm/kv/state_layout.py) keep a recurrent-state slot per
sequence beside its blocks: taken with its first blocks (in the same all-or-nothing check),
given back in `free`, a fresh one for each fork (core/kv/state_slots.py). With prefix
caching, the state after a prompt's last full block is saved in a snapshot named by that
block's hash (`save_state_at`), and a prefix hit is cut back to the longest run of cached
blocks that ends at a snapshot, which is copied into the new sequence's slot before its
first step (`take_state_work`). With no state layers `state_slots` is None and nothing here
changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zllm.core.kv.block_pool import BlockPool
from zllm.core.kv.free_blocks import KVBlock
from zllm.core.kv.prefix_lookup import (
    PrefixHit,
    TierOf,
    first_needed_block,
    longest_hit,
    no_hit,
)
from zllm.core.kv.prefix_pins import PrefixPins
from zllm.core.kv.state_slots import StateSlots, StateSnapshots
from zllm.kv.block_hash import BlockHash, hash_full_blocks
from zllm.protocol import MAX_BLOCK_CELLS

# A hybrid model's state is also saved at a multiple of this many tokens of a prompt (rounded
# to whole blocks; the furthest a step's chunk passes), so prompts longer than a step that
# share a long prefix but not their ends hit it.
SNAPSHOT_INTERVAL = 512


@dataclass(slots=True)
class _RequestBlocks:
    tables: list[list[KVBlock | None]]  # one block table per KV cache group
    # Hash chain of its full blocks registered so far (the same tokens in every group).
    hashes: list[BlockHash]
    # Per group: table entries before this index are released (None).
    num_released: list[int]
    salt: BlockHash | None = None  # its hash chain's salt (cache_salt)


class BlockManager:
    """Allocates KV blocks to requests, shares cached prefixes, and copies on write; every
    block it hands a request comes from `pool` and goes back to it.

    `sliding_windows`: one entry per KV cache group (None: full attention); one full group
    by default.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
        record_evictions: bool = False,
        max_pinned_blocks: int = 0,
        num_state_slots: int = 0,
    ):
        """`record_evictions`: the pool keeps (tier key, block id) of each cached block
        evicted, for the KV tiers (`take_evicted`; the key is `group_block_key` of its hash
        and group). `max_pinned_blocks`: the bound of `pin`. `num_state_slots`: a hybrid
        model's recurrent-state slots (0: no state layers)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if not sliding_windows:
            raise ValueError("need at least one KV cache group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(sliding_windows)
        self.num_groups = len(self.windows)
        # Some group frees the blocks that leave its window (the hybrid cache, or a model
        # whose every layer slides): a request holding a cached prefix may lack its early
        # blocks, so the KV tiers' hits are looked up block by block (core/kv/prefetch.py).
        self.windowed = any(w is not None for w in self.windows)
        self.pool = BlockPool(
            num_blocks,
            self.num_groups,
            # The first full-attention group speaks for the cache (a prefix hit needs it).
            kv_event_group=next((g for g, w in enumerate(self.windows) if w is None), 0),
            record_evictions=record_evictions,
            max_pinned_blocks=max_pinned_blocks,
        )
        self._requests: dict[str, _RequestBlocks] = {}
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        # Prefix caching's state snapshots, as many as the slots (zllm/kv/state_layout.py).
        self.snapshots = (
            StateSnapshots(num_state_slots) if num_state_slots and enable_prefix_caching else None
        )
        # The step's snapshot work: (snapshot, state slot) restores before its forward,
        # (request, position, snapshot) saves during it.
        self._state_restores: list[tuple[int, int]] = []
        self._state_saves: list[tuple[str, int, int]] = []
        self._pending_copies: list[tuple[int, int]] = []
        # Requests whose block table changed since `take_changed_tables` was last called.
        self._changed_tables: set[str] = set()
        # Prefix-cache statistics, in tokens (as vLLM counts them).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- introspection -------------------------------------------------------------------
    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """One group's block table (-1 for released entries)."""
        blocks = self._requests.get(req_id)
        if blocks is None:
            return []
        return [-1 if b is None else b.block_id for b in blocks.tables[group]]

    def block_hashes(self, req_id: str) -> list[BlockHash]:
        """The hash chain of the request's full blocks registered so far (with prefix
        caching; the same blocks in every group)."""
        blocks = self._requests.get(req_id)
        return [] if blocks is None else list(blocks.hashes)

    def state_slot(self, req_id: str) -> int:
        """The recurrent-state slot the request holds (-1: none, or no state layers)."""
        return -1 if self.state_slots is None else self.state_slots.slot_of(req_id)

    def group_block_ids(self, req_id: str) -> list[list[int]]:
        """Every group's block table: what the executor receives."""
        return [self.block_ids(req_id, g) for g in range(self.num_groups)]

    def num_held_blocks(self, req_id: str, group: int | None = None) -> int:
        """Blocks the request holds (not released), in one group or all."""
        blocks = self._requests.get(req_id)
        if blocks is None:
            return 0
        tables = blocks.tables if group is None else [blocks.tables[group]]
        # (len - count: C loops; this runs for every running request each step)
        return sum(len(table) - table.count(None) for table in tables)

    def blocks_needed(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks one request of `num_tokens` holds at once when prefilled in chunks
        of up to `chunk_tokens`: a sliding group holds its window plus the chunk being
        written. What the scheduler sizes the longest admissible context by."""
        total = -(-num_tokens // self.block_size)
        needed = 0
        for window in self.windows:
            if window is None:
                needed += total
            else:
                span = -(-(window - 1 + chunk_tokens) // self.block_size) + 1
                needed += min(total, span)
        return needed

    def longest_sequence(self, limit: int, chunk_tokens: int) -> int:
        """`limit`, or less: the most tokens one request can hold with the whole pool to
        itself, prefilled in chunks of `chunk_tokens`."""

        def fits(n: int) -> bool:
            return self.blocks_needed(n, chunk_tokens) <= self.num_blocks

        if fits(limit):
            return limit
        low, high = 0, limit  # fits(low), not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    # ---- the pool, for callers that hold the manager -------------------------------------
    # (The scheduler, the engine core and the KV tiers' hooks reach the pool through the
    # manager; each of these is documented where it lives, in BlockPool.)
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def pins(self) -> PrefixPins:
        return self.pool.pins

    def num_referenced_blocks(self) -> int:
        return self.pool.num_referenced_blocks()

    def block_states(self, max_cells: int = MAX_BLOCK_CELLS) -> tuple[bytes, int]:
        return self.pool.block_states(max_cells)

    def unpin_expired(self, now: float) -> None:
        self.pool.unpin_expired(now)

    def release_pins(self, count: int | None = None) -> None:
        self.pool.release_pins(count)

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        return self.pool.take_evicted()

    def evict_cached(self) -> list[tuple[BlockHash, int]]:
        return self.pool.evict_cached()

    def drop_cached(self) -> int:
        """POST /reset_prefix_cache: see `BlockPool.drop_cached` (running requests' blocks
        stay cached)."""
        return self.pool.drop_cached()

    def record_kv_events(self) -> None:
        self.pool.record_kv_events()

    def take_kv_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        return self.pool.take_kv_events()

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        salt: BlockHash | None = None,
        hashes: list[BlockHash] | None = None,
        tier_of: TierOf | None = None,
    ) -> PrefixHit:
        """The longest run of cached full blocks that starts `token_ids`, in every group.

        At most `len(token_ids) - 1` tokens are reported cached: the last token's logits must
        be computed. Takes no references (see `allocate_slots`). `hashes`: what
        `prefix_hashes` gave for these tokens, if the caller kept it. `tier_of`: the KV tier
        holding a block's tier key (None: none does); with it, each group's block the pool
        lacks may come from a tier (`PrefixHit.loads`).
        """
        if not self.enable_prefix_caching:
            return self._no_hit()
        if hashes is None:
            hashes = self.prefix_hashes(token_ids, salt)
        cached = self.pool.cached_blocks
        hit = longest_hit(cached, self.windows, self.block_size, hashes, tier_of)
        while self.snapshots is not None:  # a hybrid's hit ends where a state was saved
            k = hit.num_blocks
            while k and not self.snapshots.ready(hashes[k - 1]):
                k -= 1
            if k == hit.num_blocks:
                break
            # (looked up again: a sliding group may need other blocks for a shorter hit)
            hit = longest_hit(cached, self.windows, self.block_size, hashes[:k], tier_of)
        hit.candidate_hashes = hashes
        return hit

    def prefix_hashes(self, token_ids: Sequence[int], salt: BlockHash | None) -> list[BlockHash]:
        """The hash chain of the full blocks of `token_ids` a prefix hit could take (not one
        ending with the last token); [] without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        num_blocks = (len(token_ids) - 1) // self.block_size
        return hash_full_blocks(
            token_ids[: num_blocks * self.block_size], self.block_size, salt=salt
        )

    def _no_hit(self) -> PrefixHit:
        return no_hit(self.num_groups)

    def _sliding_groups(self) -> list[int]:
        return [g for g, w in enumerate(self.windows) if w is not None]

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once the request it was for is admitted (not on every retry)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_prefix: PrefixHit | None = None,
        salt: BlockHash | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `req_id`; False if blocks run out.

        `token_ids` are the request's known tokens (prompt + output so far). On the first call
        for a request, `cached_prefix` (from `find_cached_prefix`) is taken over and
        `num_computed_tokens` must equal its token count, and `salt` (`cache_salt`) is the
        one its lookup used. Sliding groups first release the
        blocks this step no longer reads; beyond that nothing changes when it fails.
        """
        blocks = self._requests.get(req_id)
        is_new = blocks is None
        bs = self.block_size
        if not is_new:
            assert cached_prefix is None or not cached_prefix.num_blocks
            self._release_out_of_window(req_id, blocks, num_computed_tokens)
            tables = blocks.tables
        else:
            cached_prefix = cached_prefix or self._no_hit()
            assert num_computed_tokens == cached_prefix.num_tokens
            tables = cached_prefix.tables
        total_blocks = -(-(num_computed_tokens + num_new_tokens) // bs)
        num_needed = sum(max(0, total_blocks - len(table)) for table in tables)
        if is_new:
            num_needed += len(cached_prefix.loads)  # a fresh block for each to load into
        cow = (
            []
            if is_new or num_new_tokens == 0
            else self._shared_to_write(tables, num_computed_tokens)
        )
        # Cached blocks sitting in the free queue are taken out of it, so they count too.
        num_revived = _num_revived(tables) if is_new else 0
        if num_needed + len(cow) + num_revived > self.num_free_blocks:
            return False
        if is_new and self.state_slots is not None and not self.state_slots.num_free:
            return False

        if is_new:
            blocks = self._take_prefix(req_id, cached_prefix, num_computed_tokens, salt)
            tables = blocks.tables
            if self.state_slots is not None:
                slot = self.state_slots.take(req_id)
                if self.snapshots is not None and cached_prefix.num_blocks:
                    snapshot = self.snapshots.use(cached_prefix.hashes[-1])
                    self._state_restores.append((snapshot, slot))
        self._copy_on_write(tables, cow)
        for table in tables:
            for _ in range(total_blocks - len(table)):
                table.append(self.pool.take_free())
        if is_new or cow or num_needed:
            self._changed_tables.add(req_id)
        self._register_full_blocks(blocks, token_ids, num_computed_tokens + num_new_tokens)
        return True

    def hold_prefix(self, req_id: str, hit: PrefixHit, salt: BlockHash | None) -> bool:
        """Take `hit` for `req_id` without room for any new token: its pool blocks, and a
        fresh block for each of its loads, left uncached (a fallible load's bytes are known
        good only once its step returns: `cache_loaded`); False if blocks run out."""
        assert req_id not in self._requests and hit.num_blocks
        if len(hit.loads) + _num_revived(hit.tables) > self.num_free_blocks:
            return False
        self._take_prefix(req_id, hit, hit.num_tokens, salt, cache_loads=False)
        self._changed_tables.add(req_id)
        return True

    def cache_loaded(self, req_id: str, entries: Sequence[tuple[int, int]]) -> None:
        """The (group, table index) blocks of `req_id` whose loads succeeded hold what their
        hashes name: cache them (unless that group caches another copy already)."""
        blocks = self._requests[req_id]
        for group, i in entries:
            block, block_hash = blocks.tables[group][i], blocks.hashes[i]
            if block is not None and self.pool.lookup(group, block_hash) is None:
                self.pool.cache(block, block_hash, group)

    def _shared_to_write(
        self, tables: list[list[KVBlock | None]], num_computed_tokens: int
    ) -> list[tuple[int, int]]:
        """(group, index) of the blocks a step from `num_computed_tokens` writes into that
        other sequences share (a fork's partial last block, or a block its parent allocated
        a step ahead): copied first (copy-on-write)."""
        start = num_computed_tokens // self.block_size
        return [
            (group, i)
            for group, table in enumerate(tables)
            for i in range(start, len(table))
            if table[i] is not None and table[i].ref_count > 1
        ]

    def _copy_on_write(
        self, tables: list[list[KVBlock | None]], cow: list[tuple[int, int]]
    ) -> None:
        for group, i in cow:
            shared = tables[group][i]
            assert shared is not None
            fresh = self.pool.take_free()
            self.pool.unref(shared)  # (the others sharing it keep it in use)
            tables[group][i] = fresh
            self._pending_copies.append((shared.block_id, fresh.block_id))

    def _take_prefix(
        self,
        req_id: str,
        hit: PrefixHit,
        num_computed_tokens: int,
        salt: BlockHash | None,
        cache_loads: bool = True,
    ) -> _RequestBlocks:
        """A new request's block tables: the hit's cached blocks, referenced, and a fresh
        block, cached under its hash unless `cache_loads` is False, for each one a KV tier
        loads (after the takes, so popping a free block never evicts one of the hit's)."""
        tables: list[list[KVBlock | None]] = [[] for _ in self.windows]
        for group, hit_table in enumerate(hit.tables):
            for block in hit_table:
                if block is not None:
                    self.pool.take(block)
                tables[group].append(block)
        for group, i, _ in hit.loads:
            block = self.pool.take_free()
            tables[group][i] = block
            if cache_loads:
                self.pool.cache(block, hit.hashes[i], group)
        bs = self.block_size
        released = [first_needed_block(num_computed_tokens, w, bs) for w in self.windows]
        blocks = _RequestBlocks(tables, list(hit.hashes), released, salt)
        self._requests[req_id] = blocks
        return blocks

    def _release_out_of_window(
        self, req_id: str, blocks: _RequestBlocks, num_computed_tokens: int
    ) -> None:
        """Hand back a sliding group's blocks that no query from here on sees."""
        for group in self._sliding_groups():
            first = first_needed_block(num_computed_tokens, self.windows[group], self.block_size)
            table = blocks.tables[group]
            first = min(first, len(table))
            for i in range(blocks.num_released[group], first):
                block = table[i]
                if block is not None:
                    table[i] = None
                    self.pool.unref(block)
                    self._changed_tables.add(req_id)
            blocks.num_released[group] = max(blocks.num_released[group], first)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV pool's contents are gone: sleep mode). Only
        when no request holds blocks; pins are released."""
        assert not self._requests, "reset_prefix_cache with requests holding blocks"
        self.pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    # ---- a hybrid model's state snapshots ------------------------------------------------
    def save_state_at(
        self, req_id: str, num_prompt_tokens: int, num_computed_tokens: int, num_new: int
    ) -> None:
        """A hybrid's state snapshots for the prefix cache: if the step computing `num_new`
        tokens from `num_computed_tokens` passes the end of the longest prefix the same
        prompt could hit (its last full block before its last token), or a multiple of
        SNAPSHOT_INTERVAL tokens within the prompt (a long shared system prompt), save the
        state at the furthest such position (unless that prefix has a snapshot already)."""
        if self.snapshots is None:
            return
        end = num_computed_tokens + num_new
        longest = (num_prompt_tokens - 1) // self.block_size * self.block_size
        interval = SNAPSHOT_INTERVAL // self.block_size * self.block_size or self.block_size
        candidates = [p for p in (longest, min(end, longest) // interval * interval) if p]
        position = max((p for p in candidates if num_computed_tokens < p <= end), default=0)
        hashes = self._requests[req_id].hashes
        if not position or len(hashes) < position // self.block_size:
            return  # (nothing to save; or its blocks' hashes are not all registered yet)
        block_hash = hashes[position // self.block_size - 1]
        if not self.snapshots.has(block_hash):
            self._state_saves.append((req_id, position, self.snapshots.take(block_hash)))

    def take_state_work(self) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
        """The step's snapshot restores and saves, for its SchedulerOutput; the snapshots it
        saves are usable from the next step on."""
        work = (self._state_restores, self._state_saves)
        self._state_restores, self._state_saves = [], []
        if self.snapshots is not None:
            self.snapshots.step_taken()
        return work

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Give `child_id` the parent's blocks, shared (for `n > 1` sampling, beams). False,
        holding nothing, when a hybrid model has no state slot left for it (a beam group
        whose idle beam yielded its seat): it then waits to be recomputed."""
        assert child_id not in self._requests
        parent = self._requests[parent_id]
        if self.state_slots is not None:  # (the executor copies the parent's state into it)
            if not self.state_slots.num_free:
                return False
            self.state_slots.take(child_id)
        for table in parent.tables:
            for block in table:
                if block is not None:
                    self.pool.take(block)
        self._requests[child_id] = _RequestBlocks(
            [list(t) for t in parent.tables],
            list(parent.hashes),
            list(parent.num_released),
            parent.salt,
        )
        self._changed_tables.add(child_id)
        return True

    def free(self, req_id: str, keep_hashes: bool = True) -> None:
        """Drop a request's references, tail first, so its tail is evicted before its head.

        `keep_hashes=False`: its blocks' contents are not what their hashes say (the executor
        never computed them: a request it could not run), so they stop being cached prefixes.
        """
        blocks = self._requests.pop(req_id, None)
        self._changed_tables.discard(req_id)
        if self.state_slots is not None:
            self.state_slots.free(req_id)
        if blocks is None:
            return
        for table in blocks.tables:
            for block in reversed(table):
                if block is not None:
                    if not keep_hashes and block.ref_count == 1:
                        self.pool.uncache(block)
                    self.pool.unref(block)

    # ---- prefix pinning ------------------------------------------------------------------
    def pin(self, req_id: str, num_tokens: int, until: float) -> int:
        """Pin the cached full blocks holding the first `num_tokens` of `req_id` until the
        time `until` (one reference each, so they are never evicted meanwhile); a block
        already pinned keeps the later time. Bounded by `pins.max_blocks`: the leading
        blocks first. Returns how many blocks are pinned for it."""
        blocks = self._requests.get(req_id)
        if blocks is None:
            return 0
        count = 0
        for table in blocks.tables:
            for block in table[: num_tokens // self.block_size]:
                if block is None or block.block_hash is None:
                    continue
                if not self.pool.pin(block, until):
                    return count
                count += 1
        return count

    def take_changed_tables(self) -> set[str]:
        changed, self._changed_tables = self._changed_tables, set()
        return changed

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the executor must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- internals -----------------------------------------------------------------------
    def _register_full_blocks(
        self, blocks: _RequestBlocks, token_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Hash the request's blocks that `num_tokens` known tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        hashes = blocks.hashes
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= len(hashes):
            return
        new_hashes = hash_full_blocks(
            token_ids[: num_full * self.block_size], self.block_size, hashes, blocks.salt
        )
        for i in range(len(hashes), num_full):
            block_hash = new_hashes[i]
            hashes.append(block_hash)
            for group, table in enumerate(blocks.tables):
                block = table[i]
                if (
                    block is not None
                    and block.block_hash is None
                    and self.pool.lookup(group, block_hash) is None
                ):
                    self.pool.cache(block, block_hash, group)


def _num_revived(tables: list[list[KVBlock | None]]) -> int:
    """Cached blocks of a prefix hit that sit in the free queue: taking them leaves fewer
    free blocks, so they count against the free space like fresh ones."""
    return sum(1 for table in tables for b in table if b is not None and b.ref_count == 0)
