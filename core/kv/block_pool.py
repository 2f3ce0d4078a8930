"""The KV block pool: every block of the executor's KV cache, the free queue, reference counts
and the index of cached full blocks. It knows blocks, never requests: core/kv/block_manager.py
keeps each request's block tables and asks the pool for every block it takes or gives back
(vLLM's BlockPool beside its KV cache manager). Plain Python, no torch.

A block is in one of three states::

    in use    ref_count > 0                      out of the free queue (hash kept, shared)
    cached    ref_count == 0, block_hash set     in the free queue and in its group's index
    free      ref_count == 0, no hash            in the free queue

Eviction is lazy: a cached block stays indexed until `take_free` hands it out again (or a
reset forgets it), so until then `take` can revive it from the middle of the free queue.
"""

from __future__ import annotations

from zllm.core.kv.free_blocks import FreeBlockQueue, KVBlock
from zllm.core.kv.prefix_pins import PrefixPins
from zllm.kv.block_hash import BlockHash, group_block_key
from zllm.protocol import MAX_BLOCK_CELLS


class BlockPool:
    """`num_blocks` blocks shared by `num_groups` KV cache groups; each group has its own
    index of cached blocks (one hash names different layers' bytes in each group).

    `kv_event_group`: the group whose index changes `take_kv_events` reports (one group
    speaks for the cache). `record_evictions`: keep (tier key, block id) of each cached
    block evicted, for the KV tiers (`take_evicted`). `max_pinned_blocks`: the bound of `pin`.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        kv_event_group: int = 0,
        record_evictions: bool = False,
        max_pinned_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        assert 0 <= kv_event_group < num_groups
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Per group: hash of a cached full block -> the block holding it for that group.
        self.cached_blocks: list[dict[BlockHash, KVBlock]] = [{} for _ in range(num_groups)]
        self._block_group: dict[int, int] = {}  # cached block id -> its group
        self._evicted: list[tuple[BlockHash, int]] | None = [] if record_evictions else None
        # Pins hold references that outlive the requests that made them: pool state.
        self.pins = PrefixPins(max_pinned_blocks)
        # Data parallel (`record_kv_events`): hashes the prefix cache gained (True) or lost
        # (False) since `take_kv_events`, the last change winning; None while not recorded.
        self._kv_events: dict[BlockHash, bool] | None = None
        self._kv_events_cleared = False
        self._kv_event_group = kv_event_group

    # ---- introspection -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_referenced_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 0)

    def block_states(self, max_cells: int = MAX_BLOCK_CELLS) -> tuple[bytes, int]:
        """The pool as one byte per cell (0 free, 1 in use, 2 cached prefix), and how many
        blocks each cell covers; a cell shows the busiest state among its blocks."""
        per_cell = -(-self.num_blocks // max_cells)
        states = bytearray(-(-self.num_blocks // per_cell))
        for block in self.blocks:
            state = 1 if block.ref_count > 0 else (2 if block.block_hash is not None else 0)
            cell = block.block_id // per_cell
            if state == 1 or (state == 2 and states[cell] == 0):
                states[cell] = state
        return bytes(states), per_cell

    # ---- references ----------------------------------------------------------------------
    def take_free(self) -> KVBlock:
        """The least recently freed block, with one reference. A cached one is evicted: its
        old contents are about to be overwritten (recorded for the KV tiers first)."""
        block = self.free_queue.popleft()
        assert block.ref_count == 0, "a block in the free queue is referenced"
        if block.block_hash is not None:
            if self._evicted is not None:
                self._evicted.append((self._tier_key(block), block.block_id))
            self.uncache(block)
        block.ref_count = 1
        return block

    def take(self, block: KVBlock) -> None:
        """One more reference to a known block; a cached free one leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def unref(self, block: KVBlock) -> None:
        """One reference less; at zero the block goes back to the free queue: at its tail
        if cached (evicted last, revivable meanwhile), at its head if it holds nothing."""
        assert block.ref_count > 0, "unref of a free block"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    # ---- the index of cached full blocks -------------------------------------------------
    def lookup(self, group: int, block_hash: BlockHash) -> KVBlock | None:
        """The block caching `block_hash` for `group`, in use or free; None: none does."""
        return self.cached_blocks[group].get(block_hash)

    def cache(self, block: KVBlock, block_hash: BlockHash, group: int) -> None:
        """`block` holds `group`'s layers of the full block `block_hash` names."""
        assert block.block_hash is None, "block is cached already"
        block.block_hash = block_hash
        self.cached_blocks[group][block_hash] = block
        self._block_group[block.block_id] = group
        if self._kv_events is not None and group == self._kv_event_group:
            self._kv_events[block_hash] = True

    def uncache(self, block: KVBlock) -> None:
        """The block stops being a cached prefix (its hash is dropped)."""
        if block.block_hash is None:
            return
        group = self._block_group.pop(block.block_id)
        cache = self.cached_blocks[group]
        if cache.get(block.block_hash) is block:
            del cache[block.block_hash]
            if self._kv_events is not None and group == self._kv_event_group:
                self._kv_events[block.block_hash] = False
        block.block_hash = None

    def _tier_key(self, block: KVBlock) -> BlockHash:
        """What the KV tiers call a cached block: its hash, told apart by its group."""
        assert block.block_hash is not None
        return group_block_key(block.block_hash, self._block_group[block.block_id])

    # ---- prefix pins ---------------------------------------------------------------------
    def pin(self, block: KVBlock, until: float) -> bool:
        """Hold one reference to a cached block in use until the time `until` (a block
        already pinned keeps the later time); False when `pins.max_blocks` are pinned."""
        assert block.ref_count > 0 and block.block_hash is not None
        return self.pins.add(block, until)

    def unpin_expired(self, now: float) -> None:
        for block in self.pins.expired(now):
            self.unref(block)

    def release_pins(self, count: int | None = None) -> None:
        """Unpin the `count` blocks whose time is up soonest, or every block (their time is
        not up, but the pool needs them)."""
        blocks = self.pins.clear() if count is None else self.pins.earliest(count)
        for block in blocks:
            self.unref(block)

    # ---- evictions and resets ------------------------------------------------------------
    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """(tier key, block id) of the cached blocks evicted since the last call: their bytes
        are still in the pool until the step that reuses them runs."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def evict_cached(self) -> list[tuple[BlockHash, int]]:
        """(tier key, block id) of every cached free block, least recently used first, each
        uncached (sleep mode stores them to the KV tiers before the pool goes)."""
        evicted = []
        for block_id in self.free_queue.block_ids():
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((self._tier_key(block), block_id))
                self.uncache(block)
        return evicted

    def drop_cached(self) -> int:
        """Release every pin, then forget every cached block nobody holds (a block in use
        stays cached: its holder's next steps read it). Returns how many blocks stopped
        being cached prefixes; their bytes are left to be overwritten (no tier stores them)."""
        self.release_pins()
        return len(self.evict_cached())

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the KV cache's contents are gone (sleep mode). Pins
        are released; every other block must be free already."""
        self.release_pins()
        assert self.num_free_blocks == self.num_blocks, "reset with blocks in use"
        for cache in self.cached_blocks:
            cache.clear()
        self._block_group.clear()
        for block in self.blocks:
            block.block_hash = None
        if self._kv_events is not None:
            self._kv_events, self._kv_events_cleared = {}, True

    # ---- KV events (data parallel routing) -----------------------------------------------
    def record_kv_events(self) -> None:
        """Start keeping the prefix cache's changes for `take_kv_events`."""
        if self._kv_events is None:
            self._kv_events = {}

    def take_kv_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """The hashes cached and uncached since the last call, and whether the whole cache
        was emptied before them (`reset_prefix_cache`)."""
        events, cleared = self._kv_events or {}, self._kv_events_cleared
        if self._kv_events is not None:
            self._kv_events, self._kv_events_cleared = {}, False
        stored = [h for h, present in events.items() if present]
        return stored, [h for h, present in events.items() if not present], cleared
