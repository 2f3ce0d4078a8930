"""Structured outputs in the executor: a token-level grammar matcher per request, and the
mask it puts on the logits before sampling.

Why here, beside the sampler: the core schedules step N+1 before step N's tokens come back,
so a mask built in the core from the last token it knows would be one token stale. The
executor samples the tokens itself: it advances each request's matcher with the token it just
sampled (`RequestState.append`), and the next step's mask follows from exactly the tokens the
model has seen. No request waits for a round trip.

    GrammarCompiler   one per executor: llguidance's tokenizer (built on first use from the
                      model's tokenizer) and a cache of compiled matchers by grammar text
    GrammarMatcher    one per request (and per sample of an n > 1 request): consumes each
                      output token; fills its row of the step's bitmask
    apply_bitmask     the rows' masks onto their logits: disallowed tokens -> -inf

A preempted request comes back as a NewRequestData with the tokens it already produced; its
matcher is rebuilt and fed them. A sample forked from an n > 1 request gets its own matcher
fed its first token. Prefix-cache hits change nothing here: the grammar reads output tokens
only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from zllm.structured_outputs import StructuredOutputsParams, grammar_of

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (a pristine matcher each, copied per request)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher) -> None:  # an llguidance.LLMatcher
        self._matcher = matcher

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token. The mask allowed it, so this cannot fail unless the
        sequence went past the grammar's end (ignore_eos); then the matcher stays stopped."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    def fill_mask(self, row: np.ndarray) -> None:
        """This sequence's allowed next tokens into `row` (int32 words, one bit per token)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Builds matchers for requests, on one llguidance tokenizer for the model."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._tokenizer = None  # llguidance.LLTokenizer, built on the first structured request
        self._eos_token_ids: tuple[int, ...] = ()
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def matcher(
        self,
        params: StructuredOutputsParams,
        eos_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> GrammarMatcher:
        """A matcher at the start of `params`' grammar, fed `output_token_ids` (the tokens a
        recomputed or forked sequence already has)."""
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer(eos_token_ids)
        grammar = grammar_of(params)
        pristine = self._compiled.get(grammar)
        if pristine is None:
            start = time.perf_counter()
            pristine = LLMatcher(tokenizer, grammar, log_level=0)
            if pristine.is_error():  # the tokenizer worker validated it; say so if not
                raise ValueError(f"grammar failed to compile: {pristine.get_error()}")
            logger.debug("compiled a %s grammar in %.1f ms", params.kind, _ms(start))
            self._compiled[grammar] = pristine
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        matcher = GrammarMatcher(pristine.deep_copy())
        for token in output_token_ids:
            matcher.consume(token)
        return matcher

    def _llg_tokenizer(self, eos_token_ids: Sequence[int]):
        """llguidance's view of the model's vocabulary: token bytes for every id below the
        model's vocab_size (logit rows past the tokenizer's are never allowed), and the ids
        that end a sequence (allowed once the grammar is complete)."""
        eos = tuple(eos_token_ids)
        if self._tokenizer is None or eos != self._eos_token_ids:
            from llguidance import LLTokenizer

            from zllm.tokenizer import load_tokenizer

            start = time.perf_counter()
            backend = load_tokenizer(self.model_path).backend
            self._tokenizer = LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=list(eos) or None
            )
            self._eos_token_ids = eos
            self._compiled.clear()
            logger.info("Structured outputs: grammar tokenizer built in %.0f ms", _ms(start))
        return self._tokenizer


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)], every token allowed until a matcher fills its row."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


_BIT = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """logits [N, vocab]: in each of `rows`, tokens whose bit is 0 become -inf (in place)."""
    words = torch.from_numpy(bitmask).to(logits.device)
    allowed = ((words.unsqueeze(-1) >> _BIT.to(logits.device)) & 1).bool()
    allowed = allowed.view(len(rows), -1)[:, : logits.shape[1]]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
