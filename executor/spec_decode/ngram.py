"""Prompt-lookup proposals: the tokens that followed the last earlier occurrence of the
sequence's final n-gram (longest n first), taken from the prompt and the output so far.

Free: no forward, a vectorised search over the sequence's tokens. It pays where the output
repeats its input (summaries, edits, code with repeated identifiers) and proposes nothing
where no n-gram recurs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from zllm.executor.requests.state import RequestState


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def after_step(
        self, stepped: Sequence[tuple[RequestState, int]], propose_for: Sequence[RequestState]
    ) -> list[list[int]]:
        """Proposals for the requests that sampled (`stepped` is for proposers with a cache)."""
        return [self.propose_one(st.all_token_ids) for st in propose_for]

    def copy_block(self, src: int, dst: int) -> None:
        """Nothing to copy: n-gram lookup keeps no KV."""

    def propose_one(self, tokens: Sequence[int]) -> list[int]:
        """Up to k tokens continuing `tokens`, or none when no suffix n-gram recurs."""
        num = len(tokens)
        if num < self.lookup_min + 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.lookup_max, num - 1), self.lookup_min - 1, -1):
            suffix = ids[num - n :]
            # Earlier windows only: a match must end before the suffix itself starts over.
            windows = sliding_window_view(ids[: num - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # what followed the most recent occurrence
                return ids[start : start + self.k].tolist()
        return []
