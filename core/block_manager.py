"""The KV block manager: who owns which cache block, and which blocks hold a known prefix.

The executor's KV pool is `num_blocks` fixed-size blocks. This module decides which block ids
each request's tokens live in; it never sees tensor data. Plain Python, no torch.

A request's block table maps its token positions to blocks::

    positions  0..15      16..31     32..40 (partial)
    blocks    [ 7 ]      [ 3 ]      [ 12 ]
    hashes    h0=H(-,t0..15)  h1=H(h0,t16..31)   (none: not full yet)

Full blocks are identified by a hash chain over their tokens (the parent's hash, then the
block's token ids), so two requests with the same first k*block_size tokens share the same k
blocks (automatic prefix caching). Blocks are reference counted. A block whose count drops to
zero goes back to the free queue but keeps its hash until the block is reused (lazy eviction),
so a later request with that prefix can take it back out of the middle of the queue. The free
queue is a doubly linked list: popping the head (least recently freed), appending and
removing from the middle are all O(1).

`n > 1` requests fork: children share the parent's blocks (ref counts up). A shared block that
is about to be written (the partial last block) is copied first (copy-on-write); the copies a
step needs are returned by `take_pending_copies` and carried out by the executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zllm.protocol import MAX_BLOCK_CELLS

BlockHash = int


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


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chain a block's tokens onto its parent's hash. Tuples of ints hash deterministically."""
    return hash((parent_hash, tuple(token_ids)))


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: list[BlockHash] | None = None
) -> list[BlockHash]:
    """Hash chain of every full block of `token_ids`, extending the `known` prefix of it."""
    hashes = list(known) if known else []
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


class BlockManager:
    """Allocates KV blocks to requests, shares cached prefixes, and copies on write."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Per request: hashes of its full blocks registered so far (a prefix of its hash chain).
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Requests whose block table changed since `take_changed_tables` was last called.
        self._changed_tables: set[str] = set()
        # Prefix-cache statistics, in tokens (as vLLM counts them).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- introspection -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(req_id, ())]

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

    def num_referenced_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 0)

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[KVBlock]:
        """The longest run of cached full blocks that starts `token_ids`.

        At most `len(token_ids) - 1` tokens are reported cached: the last token's logits must
        be computed. Takes no references (see `allocate_slots`).
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            parent = hash_block_tokens(
                parent, token_ids[i * self.block_size : (i + 1) * self.block_size]
            )
            block = self.cached_blocks.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

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
        cached_prefix: list[KVBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `req_id`; False if blocks run out.

        `token_ids` are the request's known tokens (prompt + output so far). On the first call
        for a request, `cached_prefix` (from `find_cached_prefix`) is taken over and
        `num_computed_tokens` must equal its token count. Nothing changes when it fails.
        """
        table = self.block_tables.get(req_id)
        is_new = table is None
        cached_prefix = cached_prefix or []
        if not is_new:
            assert not cached_prefix, "cached prefix is only taken on a request's first call"
        else:
            assert num_computed_tokens == len(cached_prefix) * self.block_size
        have = len(cached_prefix) if is_new else len(table)
        total_tokens = num_computed_tokens + num_new_tokens
        num_needed = max(0, -(-total_tokens // self.block_size) - have)
        # Copy-on-write: blocks this step writes into that other sequences share (a fork's
        # partial last block, or a block its parent allocated a step ahead).
        cow = (
            []
            if is_new or num_new_tokens == 0
            else [
                i
                for i in range(num_computed_tokens // self.block_size, len(table))
                if table[i].ref_count > 1
            ]
        )
        # Cached blocks sitting in the free queue are taken out of it, so they count too.
        num_revived = sum(1 for b in cached_prefix if b.ref_count == 0)
        if num_needed + len(cow) + num_revived > self.num_free_blocks:
            return False

        if is_new:
            table = self.block_tables[req_id] = []
            for block in cached_prefix:
                self._take(block)
                table.append(block)
            self._block_hashes[req_id] = [b.block_hash for b in cached_prefix]  # type: ignore[misc]
        for idx in cow:
            shared = table[idx]
            fresh = self._pop_free()
            shared.ref_count -= 1
            table[idx] = fresh
            self._pending_copies.append((shared.block_id, fresh.block_id))
        for _ in range(num_needed):
            table.append(self._pop_free())
        if is_new or cow or num_needed:
            self._changed_tables.add(req_id)
        self._register_full_blocks(req_id, token_ids, total_tokens)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's blocks, shared (for `n > 1` sampling)."""
        assert child_id not in self.block_tables
        table = self.block_tables[parent_id]
        for block in table:
            block.ref_count += 1
        self.block_tables[child_id] = list(table)
        self._block_hashes[child_id] = list(self._block_hashes[parent_id])
        self._changed_tables.add(child_id)

    def free(self, req_id: str) -> None:
        """Drop a request's references, tail first, so its tail is evicted before its head."""
        table = self.block_tables.pop(req_id, None)
        self._block_hashes.pop(req_id, None)
        self._changed_tables.discard(req_id)
        if table is None:
            return
        for block in reversed(table):
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def take_changed_tables(self) -> set[str]:
        changed, self._changed_tables = self._changed_tables, set()
        return changed

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the executor must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def _pop_free(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _register_full_blocks(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the request's blocks that `num_tokens` known tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes[req_id]
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= len(hashes):
            return
        table = self.block_tables[req_id]
        new_hashes = hash_full_blocks(
            token_ids[: num_full * self.block_size], self.block_size, hashes
        )
        for i in range(len(hashes), num_full):
            block_hash = new_hashes[i]
            block = table[i]
            hashes.append(block_hash)
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block
