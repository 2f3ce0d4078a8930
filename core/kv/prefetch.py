"""A sliding-window KV cache group (several groups, or a model whose every layer slides), or
pipeline stages, and a tier whose loads can fail (disk, remote): a request's prefix is
loaded in a step ahead of its own compute (a prefetch), never in the step that computes.

With one full-attention group on one stage a failed load is recomputed in the very step that
loads it (executor/model_runner.py `_transfer_kv`): the request restarts at the failed block
and holds every block before it. A sliding-window group's request that took a cached prefix holds only
the window of the prefix's end, so it has no blocks to recompute an earlier failed block
from. With pipeline stages each stage loads its own layers' part of a block, and stage 0 has
run its layers by the time stage s finds its part failed: the stages cannot all start the
request at the failed block in that step (they would have to agree before stage 0's forward,
stalling the pipeline). So such a hit goes in two steps::

    step N      the hit's pool blocks referenced, its loads into fresh blocks left uncached;
                the request computes nothing and is passed over while N is out
    N returns   the loads that succeeded: their blocks cached under their hashes; failed
                ones: the tier copy forgotten (`TieredKVConnector.load_failed`), the block
                stays uncached (garbage is never served); every block of the request freed
    later       re-admitted through the normal lookup: the pool holds the good blocks, a
                failed one is in neither pool nor tier, so its hit stops before it and the
                request computes the rest

Freeing and looking up again (rather than keeping the blocks and admitting directly) reuses
the whole admission path (budget, chunking, blocks running out, policies) and keeps blocks
off a request that waits for its turn. The fresh blocks stay uncached while step N is out so
that no other request takes one as a hit before its bytes are known good. A request
prefetches at most once: its later lookups see only the tiers whose loads cannot fail (the
CPU tier), so blocks evicted again before its re-admission cannot make it prefetch forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.prefix_lookup import PrefixHit
from zllm.core.request import Request
from zllm.kv.block_hash import BlockHash
from zllm.kv.tiers import FALLIBLE_TIERS


@dataclass(slots=True)
class Prefetch:
    req: Request
    loads: list[tuple[int, int, BlockHash]]  # (group, table index, tier key)
    step_id: int = 0  # the step carrying its loads (0: not built yet)


class Prefetches:
    """The prefetches in flight, by request id."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._by_req: dict[str, Prefetch] = {}

    def __len__(self) -> int:
        return len(self._by_req)

    def wanted(self, req: Request, hit: PrefixHit | None) -> bool:
        """Whether `req`'s hit loads from a tier that can fail (and `req` never prefetched).
        A hit lists loads only where they are looked up block by block, with a
        sliding-window group or pipeline stages (`SchedulerConnector.per_block_lookup`);
        elsewhere a failed load is recomputed in its step."""
        if hit is None or req.num_prefetched_tokens is not None:
            return False
        return any(tier in FALLIBLE_TIERS for _, _, tier in hit.loads)

    def start(self, req: Request, hit: PrefixHit, keys: Sequence[BlockHash]) -> None:
        """`req` holds `hit` (BlockManager.hold_prefix); `keys`: the tier key of each load."""
        loads = [(group, i, key) for (group, i, _), key in zip(hit.loads, keys, strict=True)]
        self._by_req[req.req_id] = Prefetch(req, loads)

    def holds(self, req: Request) -> bool:
        """Whether `req` waits for its prefetch's step."""
        prefetch = self._by_req.get(req.req_id)
        return prefetch is not None and prefetch.req is req

    def sent(self, step_id: int) -> None:
        """The step being built carries the loads of the prefetches started for it."""
        for prefetch in self._by_req.values():
            if not prefetch.step_id:
                prefetch.step_id = step_id

    def returned(self, step_id: int, failures: Sequence[tuple[int, BlockHash]]) -> None:
        """Step `step_id` came back, its loads in `failures` failed: each prefetch it
        carried caches its good blocks and frees them all for the request's next lookup."""
        done = [p for p in self._by_req.values() if p.step_id == step_id]
        failed = {key for _, key in failures}
        bm = self.block_manager
        for prefetch in done:
            req = prefetch.req
            del self._by_req[req.req_id]
            if req.is_finished:
                continue  # (its blocks were freed as it ended; the loads stayed uncached)
            good = [(group, i) for group, i, key in prefetch.loads if key not in failed]
            bad = {i for _, i, key in prefetch.loads if key in failed}
            bm.cache_loaded(req.req_id, good)
            bm.free(req.req_id)
            # What its next lookup finds in the pool that was counted as a tier hit here.
            req.num_prefetched_tokens = len({i for _, i in good} - bad) * bm.block_size
