"""What the executor keeps of each request between steps.

The core sends a request's full data once (NewRequestData) and afterwards only what changed;
the executor keeps the rest here, with what never crosses the wire: all its token ids in one
list (the next step's inputs) and its seeded generator (a sample's stream continues across
steps, and across a preemption, which the executor does not see).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zllm.protocol import ForkedRequestData, NewRequestData, PlacedImage
from zllm.sampling_params import SamplingParams
from zllm.text.thinking_budget import ThinkingTracker

if TYPE_CHECKING:
    from zllm.executor.requests.structured_output import GrammarMatcher


@dataclass(slots=True)
class RequestState:
    """What the executor keeps of a request between steps: the wire's NewRequestData, made
    mutable, plus what never crosses the wire (all its tokens in one list, its generator)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one block table per KV cache group
    num_computed_tokens: int
    eos_token_ids: list[int]
    generator: torch.Generator | None
    all_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: where the output is in its grammar (set by the model runner).
    grammar: GrammarMatcher | None = None
    # Embeddings requests: the sum of the prompt's final hidden states so far (mean pooling),
    # or its first token's (cls: executor/pooling.py).
    pool_sum: torch.Tensor | None = None
    # Draft-model speculation: positions the draft's KV cache holds, and the proposals whose
    # KV it wrote after them (executor/spec_decode/draft_model.py).
    draft_num_computed: int = 0
    draft_tail: list[int] = field(default_factory=list)
    lora_int_id: int | None = None  # its LoRA adapter (None: the base model)
    # A thinking budget: where the output is in its reasoning (zllm/text/thinking_budget.py).
    thinking: ThinkingTracker | None = None
    # Tokens sampled by launched steps and not appended yet: the asynchronous executor's
    # next step reads them on the device (executor/async_steps.py, step_inputs.py).
    num_pending: int = 0
    # Its images, where their tokens sit (executor/models/vision/features.py encodes them).
    images: list[PlacedImage] = field(default_factory=list)
    # A hybrid model's recurrent-state slot (executor/kv/state_pool.py); -1: none.
    state_slot: int = -1

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        budget = self.sampling_params.thinking_budget
        if budget is not None:  # a new, recomputed or forked sequence: from its output
            self.thinking = ThinkingTracker(budget, self.output_token_ids)

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device | str = "cpu") -> RequestState:
        return cls(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=[list(table) for table in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            eos_token_ids=new.eos_token_ids,
            generator=make_generator(new.sampling_params.seed, new.sample_index, device),
            draft_num_computed=new.num_computed_tokens,
            lora_int_id=None if new.lora is None else new.lora.lora_int_id,
            images=list(new.images),
            state_slot=new.state_slot,
        )

    def fork(self, fork: ForkedRequestData, generator: torch.Generator | None) -> RequestState:
        """A copy sharing this request's prompt and blocks: a sample of an n > 1 request (its
        first token), or a beam-search fork (the beam's tokens, then its own next one)."""
        return RequestState(
            req_id=fork.req_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=[
                *self.output_token_ids[: fork.num_parent_outputs],
                fork.first_token_id,
            ],
            sampling_params=self.sampling_params,
            block_ids=[list(table) for table in self.block_ids],
            num_computed_tokens=self.num_computed_tokens,
            eos_token_ids=self.eos_token_ids,
            generator=generator,
            # The draft's KV of the shared prompt is valid; past it is the parent's.
            draft_num_computed=min(self.draft_num_computed, self.num_computed_tokens),
            lora_int_id=self.lora_int_id,
            images=self.images,
            state_slot=fork.state_slot,
        )

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if self.thinking is not None:
            self.thinking.consume(token_id)


def make_generator(
    seed: int | None, sample_index: int, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A seeded request's generator, on the device its sampler draws on (torch draws into a
    CUDA tensor only from a CUDA generator). A seed gives one stream per device: the same
    tokens on every run on that device, not the same tokens on CPU and GPU."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    # Each sample of an n > 1 request gets its own stream, derived from the request's seed.
    gen.manual_seed((seed + 1_000_003 * sample_index) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen
