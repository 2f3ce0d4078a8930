"""The scheduler's side of speculative decoding: which proposals a step verifies, the slots
a draft model writes, and what was accepted (vLLM's spec_decode metrics).

    step N      the executor samples a request's token and proposes up to k more
                (ModelRunnerOutput.draft_token_ids -> Request.spec_token_ids)
    step N+1    its last token + the proposals that fit (`take_drafts`): k + 1 positions
                verified in one forward; the request is held until that step returns
    returned    the first `num_accepted` proposals are kept (`count_verified`); its
                num_computed_tokens rolls back past the rejected ones, whose KV slots
                are overwritten later

The executor proposes (executor/spec_decode/); the scheduler only counts and budgets.
"""

from __future__ import annotations

from zllm.config.engine import SpeculativeConfig
from zllm.core.request import Request, RequestStatus
from zllm.protocol import SpecDecodeStats


class Speculation:
    """Speculation's rules inside a step, and its counters (the heartbeat's
    SpecDecodeStats, `stats`)."""

    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        # Steps of a request that verified proposals, proposed tokens, accepted tokens,
        # and accepted per position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * (config.num_speculative_tokens if config else 0)

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )

    def enabled_for(self, num_running: int) -> bool:
        """Whether a step over `num_running` requests proposes tokens: speculation is
        configured and the batch is not past its disable_by_batch_size."""
        spec = self.config
        if spec is None:
            return False
        return spec.disable_by_batch_size is None or num_running <= spec.disable_by_batch_size

    def lookahead(self, speculate: bool) -> int:
        """Slots a request needs beyond its step's tokens: a draft model writes its own
        proposals' keys and values."""
        return self.config.lookahead_slots if speculate and self.config else 0

    def take_drafts(
        self, req: Request, num_new: int, budget: int, speculate: bool, max_model_len: int
    ) -> list[int]:
        """The request's proposals this step can verify: only for a decode (its last token is
        all that is left to compute), within the `budget` left, max_tokens and the context
        length. The request's proposals are taken either way (stale after this step)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not (drafts and speculate) or num_new != 1 or req.num_pending_tokens:
            return []
        # Proposals sit at positions num_tokens.. (below max_model_len); the last one allowed
        # may be accepted as the final token, and the bonus token after it is dropped.
        room = min(budget - num_new, max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens)
        return drafts[: max(room, 0)]

    def count_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` proposals of `req` and accepted the first
        `num_accepted`: count them, and roll its computed tokens back past the rejected ones
        (their KV is overwritten later)."""
        req.verifying = False
        if req.status == RequestStatus.RUNNING:  # a preempted request recomputes anyway
            req.num_computed_tokens -= num_drafts - num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
