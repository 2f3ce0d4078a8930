"""Structured outputs in the executor: a token-level grammar matcher per request, and the
mask it puts on the logits before sampling.

Why in the executor, not the core: the core schedules step N+1 before step N's tokens come
back, so a mask built in the core from the last token it knows would be one token stale. The
executor samples the tokens itself: it advances each request's matcher with the token it just
sampled (`RequestState.append`), and the next step's mask follows from exactly the tokens the
model has seen. No request waits for a round trip.

    GrammarCompiler   one per executor: llguidance's tokenizer (built on first use from the
                      model's tokenizer) and a cache of compiled matchers by grammar text
    GrammarMatcher    one per request (and per sample of an n > 1 request): consumes each
                      output token; fills its row of the step's bitmask
    apply_bitmask     the rows' masks onto their logits: disallowed tokens -> lowest value

A preempted request comes back as a NewRequestData with the tokens it already produced; its
matcher is rebuilt and fed them. A sample forked from an n > 1 request gets its own matcher
fed its first token. Prefix-cache hits change nothing here: the grammar reads output tokens
only.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from zllm.executor.host_to_device import to_device
from zllm.protocol import CacheSize
from zllm.sampling_params import StructuredOutputsParams
from zllm.text.structured_outputs import grammar_of

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (a pristine matcher each, copied per request)


class GrammarMatcher:
    """One sequence's position in its grammar.

    With a trigger (StructuredOutputsParams' `after_token` or `after_tokens`), the matcher
    waits, leaving the output free, until the output ends with those tokens; then it
    constrains from the grammar's start. With `repeat`, a completed grammar goes back to
    waiting for the next trigger.
    """

    def __init__(self, pristine, trigger: Sequence[int] = (), repeat: bool = False) -> None:
        self._pristine = pristine  # an llguidance.LLMatcher at the grammar's start (shared)
        self._matcher = pristine.deep_copy()
        self.trigger = tuple(trigger)
        self.repeat = repeat
        self.waiting = bool(self.trigger)
        self._tail: tuple[int, ...] = ()  # the last tokens consumed while waiting

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token. The mask allowed it, so this cannot fail unless the
        sequence went past the grammar's end (ignore_eos); then the matcher stays stopped."""
        if self.waiting:
            self._tail = (*self._tail, token_id)[-len(self.trigger) :]
            if self._tail == self.trigger:
                self.waiting, self._tail = False, ()
                self._matcher = self._pristine.deep_copy()
            return
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)
        if self.repeat and self._matcher.is_stopped():
            self.waiting = True

    def fill_mask(self, row: np.ndarray) -> None:
        """This sequence's allowed next tokens into `row` (int32 words, one bit per token);
        while waiting for its token, every token (the row as allocated)."""
        if not self.waiting:
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill_draft_masks(self, drafts: Sequence[int], rows: np.ndarray) -> None:
        """Speculative decoding: rows[j] gets the mask after the first j proposed tokens
        (len(rows) == len(drafts) + 1), and the matcher ends where it started.

        The matcher consumes the proposals tentatively and rolls back (llguidance's rollback;
        a trigger that fires leaves the original matcher untouched). At the first
        proposal its grammar forbids, the walk stops: that row's mask rejects it for certain,
        so the rows after it are never used."""
        saved_waiting, saved_matcher, saved_tail = self.waiting, self._matcher, self._tail
        num_consumed = 0  # tokens the saved matcher itself consumed, to roll back
        try:
            for j, row in enumerate(rows):
                self.fill_mask(row)
                if j == len(drafts):
                    break
                if not self.waiting:
                    if self._matcher.is_stopped() or not self._matcher.validate_tokens([drafts[j]]):
                        break
                    if self._matcher is saved_matcher:
                        num_consumed += 1
                self.consume(drafts[j])
        finally:
            self.waiting, self._matcher, self._tail = saved_waiting, saved_matcher, saved_tail
            if num_consumed:
                saved_matcher.rollback(num_consumed)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return not self.waiting and self._matcher.is_stopped()

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
        matcher = GrammarMatcher(pristine, params.trigger(), params.repeat)
        for token in output_token_ids:
            matcher.consume(token)
        return matcher

    def cache_size(self) -> CacheSize:
        """For /metrics: the compiled grammars kept, at most `_CACHE_SIZE`."""
        return CacheSize("executor", "structured_output_grammars", len(self._compiled), _CACHE_SIZE)

    def _llg_tokenizer(self, eos_token_ids: Sequence[int]):
        """llguidance's view of the model's vocabulary: token bytes for every id below the
        model's vocab_size (logit rows past the tokenizer's are never allowed), and the ids
        that end a sequence (allowed once the grammar is complete)."""
        eos = tuple(eos_token_ids)
        if self._tokenizer is None or eos != self._eos_token_ids:
            from llguidance import LLTokenizer

            from zllm.text.tokenizer import load_tokenizer

            start = time.perf_counter()
            spec = json.loads(load_tokenizer(self.model_path).backend.to_str())
            # llguidance treats every added token as special: its masks allow one for its
            # text (`<tool_call>`, `<think>`) while consuming it fails. Added tokens that are
            # not special are left out of its view; grammars spell their text in bytes.
            spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("special")]
            self._tokenizer = LLTokenizer(
                json.dumps(spec), n_vocab=self.vocab_size, eos_token=list(eos) or None
            )
            self._eos_token_ids = eos
            self._compiled.clear()
            logger.info("Structured outputs: grammar tokenizer built in %.0f ms", _ms(start))
        return self._tokenizer


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)], every token allowed until a matcher fills its row."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """logits [N, vocab]: in each of `rows`, tokens whose bit is 0 drop to the dtype's lowest
    value (in place); bitmask row k belongs to logits row rows[k].

    The lowest finite value rather than -inf: a softmax still gives them exactly 0, and the
    mask is one multiply-add over the rows (masked_fill is ~3x slower on CPU at 32 x 49k).
    """
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
    allowed = to_device(bits, logits.device).to(logits.dtype)
    penalty = (allowed - 1).mul_(-torch.finfo(logits.dtype).min)  # 0 or the lowest value
    if rows == list(range(logits.shape[0])):
        logits.add_(penalty)
        return
    index = to_device(rows, logits.device, torch.int64)
    logits.index_copy_(0, index, logits.index_select(0, index).add_(penalty))


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
