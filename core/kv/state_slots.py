"""Which recurrent-state slot each sequence of a hybrid model holds, and which snapshot slot
holds the state after which cached prefix (zllm/kv/state_layout.py says what a slot is).
Plain Python, no torch: the block manager takes a slot with a sequence's first blocks, gives
it back with them, and forks one for each child; it saves and restores snapshots with the
prefix cache. The executor learns a sequence's slot with its block tables
(NewRequestData / CachedRequestData / ForkedRequestData.state_slot) and does the copies
(SchedulerOutput.state_restores / state_saves)."""

from __future__ import annotations

from zllm.kv.block_hash import BlockHash


class StateSlots:
    """A free list of `num_slots` slot ids and the slot each sequence holds."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Lowest ids first: a small batch keeps touching the same few slots' memory.
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, seq_id: str) -> int:
        """The sequence's slot, -1 when it holds none."""
        return self._held.get(seq_id, -1)

    def take(self, seq_id: str) -> int:
        """A free slot for `seq_id` (its own if it holds one already)."""
        held = self._held.get(seq_id)
        if held is not None:
            return held
        if not self._free:
            raise RuntimeError(
                f"no recurrent-state slot is free for {seq_id} ({self.num_slots} slots, one "
                "per seat of the batch: the scheduler admits no more sequences than that)"
            )
        slot = self._free.pop()
        self._held[seq_id] = slot
        return slot

    def free(self, seq_id: str) -> None:
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)


class StateSnapshots:
    """Prefix caching for a hybrid model: copies of a sequence's state at a block boundary
    (after its prompt's last full block), each in a snapshot slot of its own and named by
    the hash of the block it ends, so a later prompt sharing those blocks takes back both
    its KV blocks and the state after them. Least recently used snapshots are overwritten
    first.

    A snapshot saved in a step is written after that step's forward; it becomes usable
    (`ready`) once the step has been handed to the executor (`step_taken`), which runs
    steps in order, so a restore never reads a snapshot still being written."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # block hash -> slot; dict order is least recently used first.
        self._slot_of: dict[BlockHash, int] = {}
        self._pending: set[BlockHash] = set()  # saved in the step being built
        self._free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def ready(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of and block_hash not in self._pending

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def use(self, block_hash: BlockHash) -> int:
        """A ready snapshot's slot, marked most recently used."""
        slot = self._slot_of.pop(block_hash)
        self._slot_of[block_hash] = slot
        return slot

    def take(self, block_hash: BlockHash) -> int:
        """A slot to save the state ending `block_hash` in: a free one, else the least
        recently used snapshot's (forgotten)."""
        if self._free:
            slot = self._free.pop()
        else:
            oldest = next(iter(self._slot_of))
            slot = self._slot_of.pop(oldest)
            self._pending.discard(oldest)
        self._slot_of[block_hash] = slot
        self._pending.add(block_hash)
        return slot

    def step_taken(self) -> None:
        self._pending.clear()

    def clear(self) -> None:
        """Forget every snapshot (the state pool's contents are gone, or asked to drop)."""
        self._slot_of.clear()
        self._pending.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
