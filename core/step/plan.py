"""What one `Scheduler.schedule()` call puts into a step, and how the executor hears of each
request in it: the first time whole (`NewRequestData`), afterwards only what changed
(`CachedRequestData`). The executor keeps a preempted request's state (tokens, seeded
generator), so a resumed one is sent as cached: a new block table and computed count."""

from __future__ import annotations

from dataclasses import dataclass, field

from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import SchedulerConnector
from zllm.core.kv.prefix_lookup import PrefixHit
from zllm.core.request import Request
from zllm.kv.block_hash import BlockHash, cache_salt
from zllm.protocol import CachedRequestData, NewRequestData


@dataclass(slots=True)
class PrefixFound:
    """What of a waiting request's tokens need not be computed: the pool's prefix hit (None:
    not looked up) and the blocks after it that the KV tiers load."""

    cached: PrefixHit | None
    salt: BlockHash | None
    load_tiers: list[int] = field(default_factory=list)  # the tier of each loaded block
    num_loaded: int = 0  # tokens
    # Tokens of the hit a prefetch loaded (counted as tier hits then): not pool hits.
    num_prefetched: int = 0

    @property
    def num_computed(self) -> int:
        """Tokens the request's blocks hold once admitted, before the tiers' blocks after
        the hit (`num_loaded`): the hit's, tier loads inside it included."""
        return self.cached.num_tokens if self.cached is not None else 0

    @property
    def num_pool_hit(self) -> int:
        """Tokens found in the pool (the prefix cache's hits)."""
        hit = self.cached
        if hit is None or not hit.loads:
            return max(0, self.num_computed - self.num_prefetched)
        block_size = hit.num_tokens // hit.num_blocks
        pool_hit = (hit.num_blocks - hit.num_loaded_blocks) * block_size
        return max(0, pool_hit - self.num_prefetched)

    @property
    def num_tokens(self) -> int:
        return self.num_computed + self.num_loaded


def find_prefix(req: Request, bm: BlockManager, kv: SchedulerConnector) -> PrefixFound:
    """What of waiting `req` the prefix cache holds, and the tiers below it. Prompt logprobs
    and embeddings need every prompt position computed: no cache hits for those."""
    params = req.sampling_params
    salt = cache_salt(req.options)
    if params.prompt_logprobs is not None or params.embed:
        return PrefixFound(None, salt)
    # (a consumer's request hashed its prompt while it waited: Request.prompt_block_hashes)
    tier_of = kv.tier_of(req)
    cached = bm.find_cached_prefix(req.block_token_ids, salt, req.prompt_block_hashes, tier_of)
    load_tiers = kv.tier_hit(cached)
    prefetched = req.num_prefetched_tokens or 0
    return PrefixFound(cached, salt, load_tiers, len(load_tiers) * bm.block_size, prefetched)


@dataclass(slots=True)
class StepPlan:
    """What one `schedule()` call has put into the step so far."""

    budget: int  # tokens left
    # A vision model's image encoder tokens the step may still start (None: no limit):
    # Request.chunk_end stops a chunk before an image that does not fit; `encoder_fresh`
    # while the step has started no image (then any one image fits).
    encoder_budget: int | None = None
    encoder_fresh: bool = True
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)  # new tokens per request
    computed_before: dict[str, int] = field(default_factory=dict)  # per request, before it
    # Requests sampling their first token as n > 1 samples (SchedulerOutput.num_samples).
    num_samples: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: whether this step proposes, and the proposals it verifies.
    speculate: bool = False
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)  # back from preemption this step
    # Pipeline parallel: the most running requests this step takes (None: no limit).
    max_running: int | None = None

    def add(self, req: Request, num_new: int, drafts: list[int]) -> int:
        """`req` computes `num_new` tokens and verifies `drafts` in this step; returns the
        tokens it takes from the budget (both)."""
        self.computed_before[req.req_id] = req.num_computed_tokens
        self.scheduled.append(req)
        req.num_steps_in_flight += 1
        if drafts:
            self.spec_token_ids[req.req_id] = drafts
            req.verifying = True
        num_tokens = num_new + len(drafts)
        if self.encoder_budget is not None and req.images:
            started = req.encoder_tokens(req.num_computed_tokens, num_new)
            self.encoder_budget -= started
            self.encoder_fresh &= started == 0
        self.num_scheduled[req.req_id] = num_tokens
        self.budget -= num_tokens
        req.num_computed_tokens += num_tokens
        return num_tokens

    def request_data(
        self, bm: BlockManager, changed: set[str], pipeline: bool
    ) -> tuple[list[NewRequestData], list[CachedRequestData]]:
        """The step's requests as the executor receives them. `changed`: the requests whose
        block tables changed since the last step. `pipeline`: the executor's earlier stages
        get the tokens its last stage sampled with each step."""
        new_reqs, cached_reqs = [], []
        for req in self.scheduled:
            if not req.known_to_executor:
                new_reqs.append(self._new_data(req, bm))
                req.known_to_executor = True
                req.num_tokens_sent = req.num_tokens
                continue
            cached = CachedRequestData(
                req_id=req.req_id,
                num_computed_tokens=self.computed_before[req.req_id],
                resumed=req.req_id in self.resumed,
            )
            if req.req_id in changed:
                cached.block_ids = bm.group_block_ids(req.req_id)
                cached.state_slot = bm.state_slot(req.req_id)
            if pipeline:
                cached.new_token_ids = req.all_token_ids[req.num_tokens_sent :]
                req.num_tokens_sent = req.num_tokens
            cached_reqs.append(cached)
        return new_reqs, cached_reqs

    def _new_data(self, req: Request, bm: BlockManager) -> NewRequestData:
        return NewRequestData(
            req_id=req.req_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            sampling_params=req.sampling_params,
            block_ids=bm.group_block_ids(req.req_id),
            num_computed_tokens=self.computed_before[req.req_id],
            eos_token_ids=req.eos_token_ids,
            sample_index=req.sample_index,
            lora=req.lora,
            images=req.images,
            state_slot=bm.state_slot(req.req_id),
        )
