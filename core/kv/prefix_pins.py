"""Prefix pinning's table (`cache_control`, zllm/kv/cache_control.py): which KV blocks requests
pinned, and until when. The block pool keeps it (`BlockPool.pins`: a pin outlives its
request); the block manager pins the cached full blocks of a request's prefix
(`BlockManager.pin`). Each pinned block holds one reference, so it is never evicted, until its
time is up or the pool needs it (`release_pins`)."""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zllm.core.kv.block_manager import BlockManager
    from zllm.core.kv.free_blocks import KVBlock
    from zllm.core.request import Request


class PrefixPins:
    """Blocks pinned by requests (`cache_control`): each holds one reference until its time
    is up, at most `max_blocks` at once. Expiry is checked lazily (`expired`, every step)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._until: dict[int, tuple[KVBlock, float]] = {}  # block id -> (block, until)
        # (until, block id), stale entries skipped: a re-pin pushes its later time and leaves
        # the old entry; rebuilt from `_until` past twice its size, so re-pinning the same
        # blocks again and again (a shared system prompt) cannot grow it (issue 56).
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._until)

    def add(self, block: KVBlock, until: float) -> bool:
        """Pin `block` until `until` (or keep its later time); False when the bound is hit."""
        held = self._until.get(block.block_id)
        if held is not None:
            if until > held[1]:
                self._until[block.block_id] = (block, until)
                self._push(until, block.block_id)
            return True
        if len(self._until) >= self.max_blocks:
            return False
        block.ref_count += 1
        self._until[block.block_id] = (block, until)
        self._push(until, block.block_id)
        return True

    def _push(self, until: float, block_id: int) -> None:
        if len(self._heap) >= 2 * len(self._until) + 64:
            self._heap = [(t, b) for b, (_, t) in self._until.items()]
            heapq.heapify(self._heap)
            return  # the rebuilt heap already holds (until, block_id)
        heapq.heappush(self._heap, (until, block_id))

    @property
    def heap_entries(self) -> int:
        """Entries in the expiry heap, stale ones included (at most 2 x pins + 64)."""
        return len(self._heap)

    def expired(self, now: float) -> list[KVBlock]:
        """Unpin the blocks whose time is up; returns them (the caller drops the reference)."""
        gone: list[KVBlock] = []
        while self._heap and self._heap[0][0] <= now:
            until, block_id = heapq.heappop(self._heap)
            held = self._until.get(block_id)
            if held is not None and held[1] == until:
                del self._until[block_id]
                gone.append(held[0])
        return gone

    def clear(self) -> list[KVBlock]:
        blocks = [block for block, _ in self._until.values()]
        self._until.clear()
        self._heap.clear()
        return blocks

    def earliest(self, count: int) -> list[KVBlock]:
        """Unpin the `count` blocks whose time is up soonest; returns them."""
        order = sorted(self._until.items(), key=lambda item: item[1][1])[:count]
        for block_id, _ in order:
            del self._until[block_id]  # (their heap entries go stale: skipped, or rebuilt)
        return [block for _, (block, _) in order]


def pin_computed_prefix(req: Request, bm: BlockManager) -> None:
    """Once the step computing the end of a request's pinned prefix is scheduled, pin its
    blocks (they hold it by the time any later step reads them: steps run in order)."""
    pin = req.cache_pin
    assert pin is not None
    num_tokens = min(pin.num_tokens, req.num_prompt_tokens)
    if req.num_computed_tokens >= num_tokens:
        req.pinned = True
        bm.pin(req.req_id, num_tokens, time.monotonic() + pin.ttl_s)
