"""A thinking budget: once a request's reasoning reaches `max_tokens` tokens without closing,
the engine writes the end-of-thinking marker for it (Anthropic's `thinking.budget_tokens`,
vLLM's `thinking_token_budget` on Chat Completions and Responses: `budget_for` builds it).

    output:  [<think>] r r r ... r  </think>  answer ...
                       └─ max_tokens ─┘└ forced, token by token, unless the model closed it

`ThinkingBudget` travels in SamplingParams (zllm/sampling_params.py); `ThinkingTracker`
follows one sequence's output tokens (the executor feeds it each token it keeps, so it is
never a step behind, with continuous batching, streaming and preemption alike: a recomputed
or forked sequence's tracker is rebuilt from its output) and says which token the next
position must be. The executor's logits processor then allows that token only
(executor/sample/logits_processors.py).
No torch here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from zllm.sampling_params import ThinkingBudget
from zllm.text.reasoning_parser import reasoning_markers


def budget_for(num_tokens: int, reasoning_parser: str, tokenizer) -> ThinkingBudget:
    """A budget of `num_tokens` reasoning tokens, its markers those of `reasoning_parser`
    as `tokenizer` (zllm.text.tokenizer.Tokenizer) encodes them."""
    start, end = reasoning_markers(reasoning_parser)
    return ThinkingBudget(
        max_tokens=num_tokens,
        end_token_ids=tokenizer.encode(end, add_special_tokens=False),
        start_token_ids=tokenizer.encode(start, add_special_tokens=False) if start else [],
    )


def _advance(progress: int, marker: Sequence[int], token: int) -> int:
    """How much of `marker` the output ends with after `token`, given `progress` before it
    (markers are a token or two: a restart at the first token is enough)."""
    if token == marker[progress]:
        return progress + 1
    return 1 if token == marker[0] else 0


class ThinkingTracker:
    """Where one sequence is: before the reasoning, in it (and how long), or past its end."""

    __slots__ = ("budget", "inside", "closed", "num_reasoning", "start_seen", "end_seen")

    def __init__(self, budget: ThinkingBudget, output_token_ids: Sequence[int] = ()) -> None:
        self.budget = budget
        self.inside = not budget.start_token_ids
        self.closed = False
        self.num_reasoning = 0  # reasoning tokens so far (markers not counted)
        self.start_seen = 0  # tokens of the start marker matched, before the reasoning
        self.end_seen = 0  # tokens of the end marker matched, inside it
        for token in output_token_ids:
            self.consume(token)

    def consume(self, token: int) -> None:
        if self.closed:
            return
        budget = self.budget
        if not self.inside:
            self.start_seen = _advance(self.start_seen, budget.start_token_ids, token)
            if self.start_seen == len(budget.start_token_ids):
                self.inside = True
            return
        before = self.end_seen
        self.end_seen = _advance(before, budget.end_token_ids, token)
        if self.end_seen == len(budget.end_token_ids):
            self.closed = True
        else:  # the tokens no longer part of a possible end marker were reasoning
            self.num_reasoning += before + 1 - self.end_seen

    def forced_token(self) -> int | None:
        """The token the next position must be: the end marker's next one once the budget
        is spent (the marker may already have begun), else None (free)."""
        if not self.inside or self.closed or self.num_reasoning < self.budget.max_tokens:
            return None
        return self.budget.end_token_ids[self.end_seen]

    def forced_tokens(self, drafts: Sequence[int]) -> list[int | None]:
        """Speculative decoding: the forced token at each of len(drafts) + 1 positions, row j
        after the first j proposals (this tracker is left as it was)."""
        walker = copy.copy(self)
        forced = []
        for j in range(len(drafts) + 1):
            forced.append(walker.forced_token())
            if j < len(drafts):
                walker.consume(drafts[j])
        return forced
