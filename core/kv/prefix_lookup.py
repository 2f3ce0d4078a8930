"""Which cached blocks a new request can take over: the longest prefix of its full blocks
that every KV cache group holds (no torch, no allocation: `BlockManager.allocate_slots`
takes the hit).

A full-attention group needs every block of the prefix; a sliding-window group only the
blocks inside the window of the prefix's end (`first_needed_block`), so a longer prefix can
hit where a shorter one does not. Without tiers a block must be in the pool's prefix cache.
With KV tiers and several groups (`tier_of`), each group's block may also come from a tier,
so the hit lists loads::

    prefix blocks      0     1     2          (window: one block)
    full group       pool  pool  tier ──► loaded into a fresh block
    sliding group     -     -    pool
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zllm.core.kv.free_blocks import KVBlock
from zllm.kv.block_hash import BlockHash, group_block_key

TierOf = Callable[[BlockHash], int | None]  # the tier holding a tier key, None: none


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a new request can take over: per group, its first `num_blocks` table
    entries (None where a sliding group needs nothing: before the window)."""

    num_blocks: int
    num_tokens: int
    tables: list[list[KVBlock | None]]
    hashes: list[BlockHash]  # the hash chain of those blocks
    # The hash chain of every full block that could have been a hit (past num_blocks: where
    # the KV tiers below the pool are looked up next).
    candidate_hashes: list[BlockHash] = field(default_factory=list)
    # (group, table index, tier) of the entries the KV tiers fill (None in `tables` until
    # `allocate_slots` gives each a fresh block): a hit over several KV cache groups may
    # take any block from the pool or a tier.
    loads: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_loaded_blocks(self) -> int:
        """Blocks of the hit some group loads from a tier (not pool hits)."""
        return len({index for _, index, _ in self.loads})


def first_needed_block(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """The first block a step starting at `num_computed_tokens` reads in a group: 0 for full
    attention; with a window, the block of the earliest key the step's first query sees."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def no_hit(num_groups: int) -> PrefixHit:
    return PrefixHit(0, 0, [[] for _ in range(num_groups)], [])


def longest_hit(
    cached_blocks: list[dict[BlockHash, KVBlock]],
    windows: list[int | None],
    block_size: int,
    hashes: list[BlockHash],
    tier_of: TierOf | None = None,
) -> PrefixHit:
    """The longest k such that every group holds the blocks it needs of `hashes[:k]`, each
    in the pool's prefix cache (`cached_blocks`, per group) or, given `tier_of`, in a tier."""
    found: dict[tuple[int, int], KVBlock | int | None] = {}

    def held(group: int, i: int) -> KVBlock | int | None:
        if (group, i) not in found:
            block = cached_blocks[group].get(hashes[i])
            if block is None and tier_of is not None:
                found[group, i] = tier_of(group_block_key(hashes[i], group))
            else:
                found[group, i] = block
        return found[group, i]

    k = len(hashes)
    for group, window in enumerate(windows):  # full groups: the leading run
        if window is None:
            k = next((i for i in range(k) if held(group, i) is None), k)
    sliding = [g for g, w in enumerate(windows) if w is not None]
    while k > 0 and not all(  # sliding groups: every block of the window at k
        held(group, i) is not None
        for group in sliding
        for i in range(first_needed_block(k * block_size, windows[group], block_size), k)
    ):
        k -= 1
    if k == 0:
        return no_hit(len(windows))
    tables: list[list[KVBlock | None]] = []
    loads: list[tuple[int, int, int]] = []
    for group, window in enumerate(windows):
        first = first_needed_block(k * block_size, window, block_size)
        table: list[KVBlock | None] = [None] * first
        for i in range(first, k):
            source = held(group, i)
            if isinstance(source, KVBlock):
                table.append(source)
            else:
                assert source is not None
                table.append(None)
                loads.append((group, i, source))
        tables.append(table)
    return PrefixHit(k, k * block_size, tables, hashes[:k], loads=loads)
