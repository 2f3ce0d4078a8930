"""A KV pool block as the block manager sees it, and the free queue: a doubly linked list,
so popping the head (least recently freed), appending and taking a cached block back out of
the middle are all O(1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zllm.kv.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Free-queue links; None while the block is in use.
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels, never handed out
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._insert_before(self._tail, block)

    def appendleft(self, block: KVBlock) -> None:
        assert self._head.next is not None
        self._insert_before(self._head.next, block)

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail: the eviction order (exact-id tests read it)."""
        out, block = [], self._head.next
        while block is not None and block is not self._tail:
            out.append(block.block_id)
            block = block.next
        return out

    def _insert_before(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev is None and block.next is None, "block is already free"
        prev = anchor.prev
        assert prev is not None
        prev.next, block.prev, block.next, anchor.prev = block, prev, anchor, block
        self.num_free += 1
