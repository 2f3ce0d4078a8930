"""Every message that crosses a process boundary, as msgspec Structs, in one module.

Hot-path structs are `array_like` (encoded as msgpack arrays, not maps), `omit_defaults`, and
`gc=False` (they hold no reference cycles, so the garbage collector need not track them).
Only token ids reach the core, never text.
"""

from __future__ import annotations

import enum

import msgspec

from zllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # cancelled by the client or the operator
    ERROR = 3  # the request failed (the engine went away, a bad request found late)

    def __str__(self) -> str:
        return self.name.lower()


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for a run of positions; row i: the chosen token first, then the top-k.

    `token_ids[i][0]` is the sampled (or, for prompt logprobs, the actual next) token and
    `ranks[i]` its rank among all tokens (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


# ---- core -> executor --------------------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the executor has not seen (or is seeing again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Output tokens generated before a preemption (recomputed as part of the context).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # For a child of an `n > 1` request: which sample it is (seeds its generator).
    sample_index: int = 0


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A running request the executor already holds: only what changed."""

    req_id: str
    num_computed_tokens: int
    # The whole block table when it changed this step (new blocks or a copy-on-write), else None.
    block_ids: list[int] | None = None


class ForkedRequestData(msgspec.Struct, array_like=True, gc=False):
    """A child sequence of an `n > 1` request: a copy of its parent's state (blocks shared)
    with `first_token_id` as its first output. Applied before anything else in a step."""

    req_id: str
    parent_req_id: str
    sample_index: int
    first_token_id: int


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # Tokens to compute this step per scheduled request, in batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    forked_requests: list[ForkedRequestData] = []
    # (src, dst) block copies to do before the forward (copy-on-write).
    blocks_to_copy: list[tuple[int, int]] = []
    # Requests that finished or were aborted since the last step: the executor drops them.
    # (Preempted requests stay known to the executor, keeping their seeded generators.)
    finished_req_ids: list[str] = []


# ---- executor -> core --------------------------------------------------------------------


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    # Requests that sampled this step, and their new tokens (n tokens for a request forking).
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per sampled request (same order), when it asked for logprobs; None elsewhere.
    logprobs: list[LogprobsLists | None] = []
    prompt_logprobs: dict[str, LogprobsLists] = {}


# ---- core -> the rest ----------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str  # the client's request id
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request, as it enters the core."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None
