"""The core's side of the KV tiers: which prefix blocks each tier holds, and each step's
transfers (the executor moves the bytes: executor/kv/connector.py).

    pool (the executor's KV blocks)
      │ a cached prefix block evicted from the pool (BlockPool records it)
      ▼ stored into every tier (write-through): cpu (fast, small), disk (slower, larger)
    cpu tier ──LRU within --kv-offload-bytes──► dropped
    disk tier ─LRU within --kv-offload-disk-bytes─► file deleted

A request admitted with a prefix longer than what the pool holds looks further in the tiers
(`lookup`): the leading blocks some tier holds (the cpu tier's copy preferred) are loaded
into freshly allocated pool blocks at the start of the request's first step instead of
being computed, and the request starts computing after them. A load that fails (a lost or
corrupt disk block) is recomputed by the executor in that same step; the core forgets that
tier's copy (`load_failed`). With a sliding-window KV cache group (the hybrid cache, or a
model whose every layer slides), or pipeline stages, a hit's loads from a tier that can
fail go out in a step of their own instead (a prefetch: core/kv/prefetch.py).

`TierIndex` is one tier's `KVConnector` core side: `lookup(block_hashes)` answers how many
leading blocks it holds.

Prefill/decode disaggregation adds a third tier on a consumer, `remote`: the executor's buffer
of blocks a producer sent (executor/kv/transfer.py). The core never stores into it; its index
mirrors what the executor says it received and dropped (`received`), and its blocks load like
any tier's. With tensor or pipeline parallelism each rank's buffer holds its part of a block
(its KV heads, its stage's layers) and reports on its own: the index holds a block once every
rank of every stage does (`RemoteTierIndex`). A producer's core asks its executor, step by
step, to send the prompt blocks of the requests marked for it.

`SchedulerConnector` is what the scheduler calls (vLLM's scheduler-side connector): the
tiers' hit at admission and the loads it takes, a consumer's wait for remote blocks, and
each step's transfers and sends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from zllm.config.engine import KVOffloadConfig
from zllm.config.kv_transfer import KVTransferConfig, consumer_engine
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.prefetch import Prefetches
from zllm.core.kv.prefix_lookup import PrefixHit, first_needed_block
from zllm.core.request import Request
from zllm.kv.block_hash import BlockHash, cache_salt, group_block_key
from zllm.kv.tiers import TIER_CPU, TIER_DISK, TIER_NAMES, TIER_REMOTE
from zllm.protocol import KVRejection, KVTierStats, KVTransfers, KVTransferStats


class KVConnector(Protocol):
    """The core side of a KV connector (a tier here; a remote peer for disaggregation)."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of the leading `block_hashes` the connector can load."""
        ...


class TierIndex:
    """Which block hashes one tier holds, least recently used first, at most `capacity`."""

    def __init__(self, tier: int, capacity_blocks: int, held: Sequence[BlockHash] = ()) -> None:
        self.tier = tier
        self.capacity = capacity_blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(held)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        return next(
            (i for i, h in enumerate(block_hashes) if h not in self._lru), len(block_hashes)
        )

    def touch(self, block_hash: BlockHash) -> None:
        self._lru.move_to_end(block_hash)

    def add(self, block_hash: BlockHash, protected: set[BlockHash]) -> list[BlockHash]:
        """Hold `block_hash` (most recently used); returns the hashes evicted to make room,
        least recently used first, never one in `protected`."""
        self._lru[block_hash] = None
        self._lru.move_to_end(block_hash)
        return self.shrink(protected)

    def shrink(self, protected: set[BlockHash]) -> list[BlockHash]:
        """Evict least recently used hashes (not `protected`) until within capacity."""
        evicted: list[BlockHash] = []
        if len(self._lru) <= self.capacity:
            return evicted
        for block_hash in list(self._lru):
            if len(self._lru) <= self.capacity:
                break
            if block_hash not in protected:
                del self._lru[block_hash]
                evicted.append(block_hash)
        return evicted

    def discard(self, block_hash: BlockHash) -> None:
        self._lru.pop(block_hash, None)

    def clear(self) -> list[BlockHash]:
        """Forget every hash; returns them, least recently used first."""
        held = list(self._lru)
        self._lru.clear()
        return held


class RemoteTierIndex(TierIndex):
    """The remote tier: follows the buffers that manage their own contents, one per
    executor rank (stage x tensor-parallel size + tensor-parallel rank), each holding its
    part (its KV heads of its stage's layers) of a block. A block is held once every rank
    holds its part (a load needs them all), and not once any rank dropped it; the blocks
    some ranks hold wait in `_holders` for the others."""

    def __init__(self, capacity_blocks: int, ranks: int = 1) -> None:
        super().__init__(TIER_REMOTE, capacity_blocks)
        self.ranks = ranks
        self._holders: dict[BlockHash, set[int]] = {}  # the ranks holding each part

    def received(self, rank: int, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> int:
        """Rank `rank`'s buffer took in `stored` and dropped `removed`; returns how many
        blocks this made held (every rank now has its part)."""
        for block_hash in removed:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(rank)
                if not holders:
                    del self._holders[block_hash]
            self._lru.pop(block_hash, None)
        held = 0
        for block_hash in stored:
            holders = self._holders.setdefault(block_hash, set())
            holders.add(rank)
            if len(holders) == self.ranks:
                held += block_hash not in self._lru
                self._lru[block_hash] = None
                self._lru.move_to_end(block_hash)
        return held

    def discard(self, block_hash: BlockHash) -> None:
        """A failed load: some rank had lost its part; forget every rank's."""
        super().discard(block_hash)
        self._holders.pop(block_hash, None)


class TieredKVConnector:
    """The tiers below the pool, as the scheduler uses them: `lookup` at admission,
    `load` for the blocks it takes from them, `evicted` for what leaves the pool, and one
    `take_transfers` per step for the executor."""

    def __init__(
        self,
        config: KVOffloadConfig | None,
        block_bytes: int,
        disk_blocks: Sequence[BlockHash] = (),
        remote_bytes: int = 0,
        remote_ranks: int = 1,
    ) -> None:
        """`disk_blocks`: what the disk tier directory already holds (oldest first).
        `remote_bytes`: a disaggregation consumer's buffer of received blocks (0: none), one
        on each of `remote_ranks` executor ranks (every stage's tensor-parallel ranks)."""
        self.tiers: list[TierIndex | None] = [None, None, None]
        if config is not None and config.cpu_bytes > 0:
            self.tiers[TIER_CPU] = TierIndex(TIER_CPU, config.cpu_bytes // block_bytes)
        if config is not None and config.disk_dir is not None:
            self.tiers[TIER_DISK] = TierIndex(
                TIER_DISK, config.disk_bytes // block_bytes, disk_blocks
            )
        if remote_bytes:
            self.tiers[TIER_REMOTE] = RemoteTierIndex(remote_bytes // block_bytes, remote_ranks)
        self.block_bytes = block_bytes
        # This step's transfers; a store cancelled by an eviction in the same step is
        # removed rather than followed by a drop (the executor never holds it).
        self._drops: list[tuple[int, BlockHash]] = []
        self._stores: dict[tuple[int, BlockHash], int] = {}
        self._loads: list[tuple[int, BlockHash, int]] = []
        self._loading: set[BlockHash] = set()  # loaded this step: not evicted in it
        # Statistics per tier (the heartbeat's KVTierStats).
        self.hit_tokens = [0, 0, 0]
        self.stored_blocks = [0, 0, 0]
        self.load_failures = [0, 0, 0]
        # A directory holding more than the disk bound (it shrank since): trim it.
        for tier in self.tiers:
            if tier is not None:
                self._drops.extend((tier.tier, h) for h in tier.shrink(set()))

    @property
    def active_tiers(self) -> list[TierIndex]:
        return [t for t in self.tiers if t is not None]

    @property
    def stored_tiers(self) -> list[TierIndex]:
        """The tiers evicted pool blocks are stored into (not the remote one)."""
        return [t for t in self.active_tiers if t.tier != TIER_REMOTE]

    def received(
        self, stored: Sequence[BlockHash], removed: Sequence[BlockHash], rank: int = 0
    ) -> None:
        """Rank `rank`'s remote buffer took in `stored` and dropped `removed`."""
        index = self.tiers[TIER_REMOTE]
        if isinstance(index, RemoteTierIndex):
            self.stored_blocks[TIER_REMOTE] += index.received(rank, stored, removed)

    # ---- admission -------------------------------------------------------------------------
    def tier_of(self, key: BlockHash) -> int | None:
        """The tier to load a block from (the cpu tier first), or None if none holds it."""
        return next((t.tier for t in self.active_tiers if key in t), None)

    def cpu_tier_of(self, key: BlockHash) -> int | None:
        """`tier_of` among the tiers whose loads cannot fail: the cpu tier."""
        cpu = self.tiers[TIER_CPU]
        return TIER_CPU if cpu is not None and key in cpu else None

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The tier to load each of the leading `block_hashes` from, as far as some tier
        holds them (the cpu tier first)."""
        found: list[int] = []
        for block_hash in block_hashes:
            tier = next((t.tier for t in self.active_tiers if block_hash in t), None)
            if tier is None:
                break
            found.append(tier)
        return found

    def load(
        self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], tiers: Sequence[int]
    ) -> None:
        """Load these blocks into these pool blocks this step (what `lookup` found)."""
        for block_hash, block_id, tier in zip(block_hashes, block_ids, tiers, strict=True):
            self._loads.append((tier, block_hash, block_id))
            self._loading.add(block_hash)
            for index in self.active_tiers:
                if block_hash in index:
                    index.touch(block_hash)

    def record_hits(self, tiers: Sequence[int], block_size: int) -> None:
        """A request's first admission took these blocks from these tiers."""
        for tier in tiers:
            self.hit_tokens[tier] += block_size

    # ---- the pool's evictions --------------------------------------------------------------
    def evicted(self, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        """Cached prefix blocks the pool evicted this step: store each into every tier
        (before the step overwrites it); one a tier already holds becomes its newest."""
        for block_hash, block_id in blocks:
            for index in self.stored_tiers:
                if block_hash in index:
                    index.touch(block_hash)
                    continue
                self._stores[(index.tier, block_hash)] = block_id
                self.stored_blocks[index.tier] += 1
                for gone in index.add(block_hash, self._loading):
                    self._forget(index.tier, gone)
                if len(index) > index.capacity:  # all else is being loaded: keep those
                    index.discard(block_hash)
                    self._forget(index.tier, block_hash)
                    self.stored_blocks[index.tier] -= 1

    def load_failed(self, failures: Sequence[tuple[int, BlockHash]]) -> None:
        """The executor could not load these (and recomputed them): forget those copies."""
        for tier, block_hash in failures:
            index = self.tiers[tier]
            if index is not None and block_hash in index:
                index.discard(block_hash)
                if tier != TIER_REMOTE:  # (the remote buffer no longer has it)
                    self._forget(tier, block_hash)
            self.load_failures[tier] += 1

    def clear_stored_tiers(self) -> list[int]:
        """POST /reset_prefix_cache?tiers=1: forget every block the cpu and disk tiers hold
        (the executor drops their bytes and files with the next transfers; a store not yet
        sent is cancelled instead). The remote tier is the producer's to fill and is left
        alone. Returns how many blocks each tier held (indexed like `tiers`)."""
        dropped = [0, 0, 0]
        for index in self.stored_tiers:
            held = index.clear()
            for block_hash in held:
                self._forget(index.tier, block_hash)
            dropped[index.tier] = len(held)
        return dropped

    def _forget(self, tier: int, block_hash: BlockHash) -> None:
        if self._stores.pop((tier, block_hash), None) is None:
            self._drops.append((tier, block_hash))

    # ---- each step -------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers | None:
        """This step's transfers, in the order the executor applies them; None if none."""
        if not (self._drops or self._stores or self._loads):
            self._loading.clear()
            return None
        transfers = KVTransfers(
            drops=self._drops,
            stores=[(tier, h, block_id) for (tier, h), block_id in self._stores.items()],
            loads=self._loads,
        )
        self._drops, self._stores, self._loads = [], {}, []
        self._loading.clear()
        return transfers

    def stats(self) -> KVTierStats:
        """The heartbeat's KV tiers section, per tier (cpu, disk, remote); a tier that is off
        reads 0."""
        return KVTierStats(
            hits=list(self.hit_tokens),
            stores=list(self.stored_blocks),
            load_failures=list(self.load_failures),
            blocks=[len(t) if t is not None else 0 for t in self.tiers],
            capacity=[t.capacity if t is not None else 0 for t in self.tiers],
        )


class SchedulerConnector:
    """The scheduler's side of the KV tiers (`tiers`, if any) and of disaggregation
    (`transfer`: this engine's part, if any)."""

    def __init__(
        self,
        block_manager: BlockManager,
        tiers: TieredKVConnector | None,
        transfer: KVTransferConfig | None,
        pipeline_stages: int = 1,
    ) -> None:
        """`pipeline_stages`: the executor's (more than one: every hit is looked up block by
        block and a fallible one prefetched, as with a sliding-window group)."""
        self.block_manager = block_manager
        self.tiers = tiers
        self.transfer = transfer
        self.pipeline = pipeline_stages > 1
        self.num_sent_blocks = 0  # a producer: prompt blocks it had the executor send
        self.num_wait_timeouts = 0  # a consumer: requests admitted without all blocks
        # A consumer: blocks its executor ranks refused, by KVRejection.
        self.num_rejected_blocks = [0] * len(KVRejection)
        self.prefetches = Prefetches(block_manager)  # core/kv/prefetch.py

    @property
    def per_block_lookup(self) -> bool:
        """Whether a hit's tier loads are found block by block (`PrefixHit.loads`, which a
        prefetch takes): with a group that frees the blocks leaving its window (several KV
        cache groups, or one of sliding layers: a hit needs only its window's blocks), or
        pipeline stages (whose stages cannot recompute a failed load in its step).
        Otherwise a pool hit, then the tiers' leading run after it (`tier_hit`)."""
        return self.block_manager.windowed or self.pipeline

    def transfer_stats(self) -> KVTransferStats | None:
        """Disaggregation's section of the heartbeat (None: this engine takes no part)."""
        if self.transfer is None:
            return None
        return KVTransferStats(
            self.transfer.role,
            self.num_sent_blocks,
            self.num_wait_timeouts,
            list(self.num_rejected_blocks),
        )

    def rejected(self, count: int, rejection: KVRejection) -> None:
        """An executor rank refused `count` blocks a producer sent (it logged why)."""
        self.num_rejected_blocks[rejection] += count

    # ---- admission -------------------------------------------------------------------------
    def awaits_remote_kv(self, req: Request) -> bool:
        """A consumer's request marked do_remote_prefill waits, without holding up the
        requests behind it, until every full block of its prompt that a prefix hit could use
        is in the pool or the remote buffer, or wait_timeout_s has passed (then what has not
        come is computed). Its prompt is hashed once (Request.prompt_block_hashes)."""
        transfer, params = self.transfer, req.kv_transfer
        if transfer is None or not transfer.consumes or params is None:
            return False
        if not params.do_remote_prefill or req.num_cached_tokens >= 0:
            return False  # (not marked, or admitted before: a preempted request)
        if req.num_prefetched_tokens is not None:
            return False  # it loaded what had come (core/kv/prefetch.py)
        if req.remote_kv_deadline == 0.0:
            return False  # waited its time already
        if req.sampling_params.prompt_logprobs is not None or req.sampling_params.embed:
            return False  # these compute every prompt position anyway
        now = time.monotonic()
        if req.remote_kv_deadline is None:
            req.remote_kv_deadline = now + transfer.wait_timeout_s
        if not self._remote_blocks_missing(req):
            return False
        if now < req.remote_kv_deadline:
            return True
        req.remote_kv_deadline = 0.0  # counted once
        self.num_wait_timeouts += 1
        return False

    def _remote_blocks_missing(self, req: Request) -> bool:
        """Whether blocks of `req`'s prompt past the pool's hit are yet to come into the
        remote buffer (False when more are wanted than it holds: they never come whole)."""
        remote = self.tiers.tiers[TIER_REMOTE] if self.tiers else None
        if self.tiers is None or remote is None:
            return False
        bm, salt = self.block_manager, cache_salt(req.options)
        if req.prompt_block_hashes is None:
            req.prompt_block_hashes = bm.prefix_hashes(req.block_token_ids, salt)
        if bm.windowed:
            return self._group_blocks_missing(req, salt, remote.capacity)
        hit = bm.find_cached_prefix(req.block_token_ids, salt, req.prompt_block_hashes)
        wanted = hit.candidate_hashes[hit.num_blocks :]
        if len(wanted) > remote.capacity:
            return False
        return len(self.tiers.lookup(wanted)) < len(wanted)

    def _group_blocks_missing(self, req: Request, salt: BlockHash | None, capacity: int) -> bool:
        """`_remote_blocks_missing` with a sliding-window group: whether a hit of the whole
        prompt lacks some group's block that neither the pool nor a tier holds (a full
        group needs every block, a sliding one those in the window of the prompt's end)."""
        assert self.tiers is not None and req.prompt_block_hashes is not None
        bm, hashes = self.block_manager, req.prompt_block_hashes
        end = len(hashes) * bm.block_size
        needed = sum(
            len(hashes) - first_needed_block(end, window, bm.block_size) for window in bm.windows
        )
        if not hashes or needed > capacity:
            return False
        hit = bm.find_cached_prefix(req.block_token_ids, salt, hashes, self.tiers.tier_of)
        return hit.num_blocks < len(hashes)

    def tier_of(self, req: Request) -> Callable[[BlockHash], int | None] | None:
        """With a sliding-window group or pipeline stages (`per_block_lookup`), what
        `BlockManager.find_cached_prefix` asks of the tiers block by block for `req` (None:
        a pool hit, then the tiers' blocks after it: `tier_hit`). A request that prefetched
        once sees only the cpu tier, so it never prefetches again (core/kv/prefetch.py)."""
        if self.tiers is None or not self.per_block_lookup:
            return None
        if req.num_prefetched_tokens is not None:
            return self.tiers.cpu_tier_of
        return self.tiers.tier_of

    def tier_hit(self, cached: PrefixHit | None) -> list[int]:
        """The tier each block after the pool's hit loads from, as far as the tiers hold
        the request's prefix ([] without tiers, and with a lookup block by block, whose hit
        holds its loads)."""
        if self.tiers is None or cached is None or cached.loads:
            return []
        if self.per_block_lookup:
            return []
        return self.tiers.lookup(cached.candidate_hashes[cached.num_blocks :])

    def admitted(
        self, req: Request, cached: PrefixHit | None, tiers: list[int], first: bool
    ) -> None:
        """`req` got its blocks: have the executor load the tiers' blocks into the pool
        blocks just allocated for them, and count them as hits on its `first` admission."""
        req.prompt_block_hashes = None  # (its wait is over)
        if cached is not None and cached.loads:
            # (a prefetch counted its blocks' hits: a block counts once)
            self._load_groups(req, cached, first and req.num_prefetched_tokens is None)
            return
        if not tiers:
            return
        assert self.tiers is not None and cached is not None
        first_block, end = cached.num_blocks, cached.num_blocks + len(tiers)
        block_ids = self.block_manager.block_ids(req.req_id)[first_block:end]
        self.tiers.load(cached.candidate_hashes[first_block:end], block_ids, tiers)
        if first:
            self.tiers.record_hits(tiers, self.block_manager.block_size)

    def _load_groups(self, req: Request, cached: PrefixHit, first: bool) -> list[BlockHash]:
        """The loads of a hit looked up block by block: each group's copy of a block
        under its tier key, into the block that group's table got for it. Returns the
        keys."""
        assert self.tiers is not None
        bm = self.block_manager
        tables = bm.group_block_ids(req.req_id)
        keys = [group_block_key(cached.hashes[i], group) for group, i, _ in cached.loads]
        block_ids = [tables[group][i] for group, i, _ in cached.loads]
        self.tiers.load(keys, block_ids, [tier for _, _, tier in cached.loads])
        if first:  # a block counts once, as the tier of its first group's load
            tier_of_block = {}
            for _, i, tier in cached.loads:
                tier_of_block.setdefault(i, tier)
            self.tiers.record_hits(list(tier_of_block.values()), bm.block_size)
        return keys

    # ---- prefetches (a sliding-window group, pipeline stages: core/kv/prefetch.py) -------
    def wants_prefetch(self, req: Request, cached: PrefixHit | None) -> bool:
        """Whether waiting `req` loads its hit in a step of its own (not computing)."""
        return self.prefetches.wanted(req, cached)

    def prefetch(self, req: Request, cached: PrefixHit | None, salt: BlockHash | None) -> bool:
        """`req` takes `cached` and has its loads go out in the step being built; it is
        passed over until that step returns (`prefetching`). False if blocks run out."""
        assert cached is not None
        if not self.block_manager.hold_prefix(req.req_id, cached, salt):
            return False
        keys = self._load_groups(req, cached, first=req.num_cached_tokens < 0)
        self.prefetches.start(req, cached, keys)
        return True

    def prefetching(self, req: Request) -> bool:
        return self.prefetches.holds(req)

    def prefetched(self, step_id: int, failures: Sequence[tuple[int, BlockHash]]) -> None:
        """Step `step_id` returned (its failed loads' tier copies already forgotten): its
        prefetches' requests go back to a lookup that finds what loaded well."""
        if len(self.prefetches):
            self.prefetches.returned(step_id, failures)

    # ---- each step -------------------------------------------------------------------------
    def load_failed(self, failures: Sequence[tuple[int, BlockHash]]) -> None:
        if failures and self.tiers is not None:
            self.tiers.load_failed(failures)

    def take_transfers(self, step_id: int = 0) -> KVTransfers | None:
        """This step's tier transfers (step `step_id`, being built): the pool's evictions
        stored, the loads taken."""
        if self.tiers is None:
            return None
        self.prefetches.sent(step_id)
        self.tiers.evicted(self.block_manager.take_evicted())
        return self.tiers.take_transfers()

    def sends(self, scheduled: Sequence[Request]) -> tuple[list[tuple[BlockHash, int]], list[int]]:
        """A producer: the (hash, block id) of every full prompt block of each request marked
        do_remote_decode whose prompt this step completes (its cached blocks too), for the
        executor to send once the forward has written them; and, to a consumer of several
        data-parallel engines, the engine each block goes to (the one its request is routed
        to there: `consumer_engine`; [] with one engine, where all go to engine 0)."""
        if self.transfer is None or not self.transfer.produces:
            return [], []
        sends: list[tuple[BlockHash, int]] = []
        engines: list[int] = []
        bm, num_engines = self.block_manager, self.transfer.consumer_engines
        for req in scheduled:
            params = req.kv_transfer
            if params is None or not params.do_remote_decode or req.kv_sent:
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                continue  # a prompt chunk: its blocks go with the last one
            req.kv_sent = True
            # The blocks a consumer's prefix hit can take: not one that ends with the
            # prompt's last token, whose logits it computes (BlockManager.find_cached_prefix).
            num_full = (req.num_prompt_tokens - 1) // bm.block_size
            hashes = bm.block_hashes(req.req_id)[:num_full]
            blocks = self._blocks_to_send(req.req_id, hashes)
            sends.extend(blocks)
            engine = consumer_engine(hashes, num_engines)
            if num_engines > 1 and engine is not None:
                engines.extend([engine] * len(blocks))
        self.num_sent_blocks += len(sends)
        return sends, engines

    def _blocks_to_send(
        self, req_id: str, hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int]]:
        """(tier key, block id) of every group's block a consumer's hit of `hashes` needs:
        a full group's every block, a sliding group's those in the window of the hit's end
        (each group's copy under its own key: group_block_key; one group: the hashes)."""
        bm, k = self.block_manager, len(hashes)
        blocks: list[tuple[BlockHash, int]] = []
        for group, window in enumerate(bm.windows):
            table = bm.block_ids(req_id, group)
            for i in range(first_needed_block(k * bm.block_size, window, bm.block_size), k):
                if table[i] >= 0:  # (a sliding block released before the last chunk: the
                    # consumer's hit is shorter, never wrong)
                    blocks.append((group_block_key(hashes[i], group), table[i]))
        return blocks


assert TIER_NAMES == ("cpu", "disk", "remote") and (TIER_CPU, TIER_DISK, TIER_REMOTE) == (0, 1, 2)
