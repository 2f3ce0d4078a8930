"""Logits processors: each one rule that edits a step's logits before the sampler draws.

They act in two places, in this order:

    logits rows (one per request, or per verified position; the model's dtype)
        │  ROW_PROCESSORS: LogitBias, AllowedTokens,       (the logprobs see these)
        │                  BadWords, GrammarMask, ThinkingBudgetEnd
        ▼  repeated for the samples of an n > 1 request
    sampler rows ── raw logprobs kept aside ── fp32 copy
        │  SAMPLER_PROCESSORS: BannedTokens, Penalties     (the logprobs do not)
        ▼
    greedy argmax / temperature ─► min-p ─► top-k/p ─► race      (sampler.py)

A row processor reads the step's SampleRows (the requests behind the rows); a sampler
processor reads the batch tensors of SamplingMetadata, built once per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from zllm.executor.host_to_device import to_device
from zllm.executor.requests.state import RequestState
from zllm.executor.requests.structured_output import allocate_bitmask, apply_bitmask
from zllm.text.bad_words import banned_next

if TYPE_CHECKING:
    from zllm.executor.sample.rows import SampleRows
    from zllm.executor.sample.sampler import SamplingMetadata


class RowProcessor(Protocol):
    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        """Edit `logits` [L, V] (one row per SampleRows.logits_states entry) in place."""


class SamplerProcessor(Protocol):
    def applies(self, metadata: SamplingMetadata) -> bool:
        """Whether `apply` would edit anything in this batch (else the sampler skips it, and
        its copy of the logits where nothing else edits them)."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """Edit the sampler's fp32 `logits` [B, V] in place."""


def rows_by_request(rows: SampleRows) -> Iterator[tuple[int, RequestState, list[int]]]:
    """(its first logits row, its state, its proposals) for each request of the step: a
    verifying request's rows follow its first, one per proposal."""
    states = rows.logits_states
    i = 0
    while i < len(states):
        st = states[i]
        drafts = rows.drafts.get(st.req_id) or []
        yield i, st, drafts
        i += len(drafts) + 1


class LogitBias:
    """A request's logit_bias: token -> value added to its logits."""

    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        row_index, cols, biases = [], [], []
        for i, st in enumerate(rows.logits_states):
            for token, bias in (st.sampling_params.logit_bias or {}).items():
                row_index.append(i)
                cols.append(token)
                biases.append(bias)
        if row_index:
            dev = logits.device
            index = (to_device(row_index, dev, torch.int64), to_device(cols, dev, torch.int64))
            values = to_device(biases, dev, logits.dtype)
            logits.index_put_(index, values, accumulate=True)


class AllowedTokens:
    """allowed_token_ids: a request's rows keep only those tokens' logits."""

    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        for i, st in enumerate(rows.logits_states):
            allowed = st.sampling_params.allowed_token_ids
            if allowed:
                index = to_device(allowed, logits.device, torch.int64)
                kept = logits[i, index]
                logits[i] = float("-inf")
                logits[i, index] = kept


class BadWords:
    """bad_words: a row may not take the token that would complete one of the request's bad
    words after its output so far (zllm/text/bad_words.py). A verifying request's row j sees
    its first j proposals as output."""

    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        if not any(st.sampling_params.bad_words_token_ids for st in rows.logits_states):
            return  # (the common step: one pass, not rows_by_request's per-row walk)
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, st, drafts in rows_by_request(rows):
            encodings = st.sampling_params.bad_words_token_ids
            if encodings:
                for j in range(len(drafts) + 1):
                    output = st.output_token_ids + drafts[:j] if j else st.output_token_ids
                    for token in banned_next(encodings, output):
                        banned_rows.append(i + j)
                        banned_tokens.append(token)
        if banned_rows:
            dev = logits.device
            index = (
                to_device(banned_rows, dev, torch.int64),
                to_device(banned_tokens, dev, torch.int64),
            )
            logits[index] = float("-inf")


class GrammarMask:
    """Structured outputs: each such request's logits rows keep only the tokens its grammar
    allows next (the samples of an n > 1 request share the row). A verifying request's row j
    gets the mask after its first j proposals: the matcher walks them and comes back
    (GrammarMatcher.fill_draft_masks)."""

    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        states = rows.logits_states
        grammar_rows = [i for i, st in enumerate(states) if st.grammar is not None]
        if not grammar_rows:
            return
        bitmask = allocate_bitmask(len(grammar_rows), logits.shape[1])
        # One by one: llguidance's thread pool (LLExecutor) measured no faster on 2 cores
        # (9.0 vs 8.7 ms for 32 regex masks).
        k = 0
        while k < len(grammar_rows):
            st = states[grammar_rows[k]]
            assert st.grammar is not None
            drafts = rows.drafts.get(st.req_id)
            if drafts:
                st.grammar.fill_draft_masks(drafts, bitmask[k : k + len(drafts) + 1])
                k += len(drafts) + 1
            else:
                st.grammar.fill_mask(bitmask[k])
                k += 1
        apply_bitmask(logits, grammar_rows, bitmask)


class ThinkingBudgetEnd:
    """A thinking budget spent: the row allows only the end marker's next token (whatever
    the bias or a grammar said: the budget is the hard limit). A verifying request's row j
    follows its first j proposals (ThinkingTracker.forced_tokens)."""

    def apply(self, logits: torch.Tensor, rows: SampleRows) -> None:
        if all(st.thinking is None for st in rows.logits_states):
            return
        forced_rows: list[int] = []
        forced_tokens: list[int] = []
        for i, st, drafts in rows_by_request(rows):
            if st.thinking is not None:
                for j, token in enumerate(st.thinking.forced_tokens(drafts)):
                    if token is not None:
                        forced_rows.append(i + j)
                        forced_tokens.append(token)
        if forced_rows:
            dev = logits.device
            index = to_device(forced_rows, dev, torch.int64)
            logits[index] = float("-inf")
            logits[index, to_device(forced_tokens, dev, torch.int64)] = 0.0


class BannedTokens:
    """min_tokens: every EOS id and stop token is forbidden until that many are out."""

    @staticmethod
    def of(st: RequestState, num_prior: int = 0) -> list[int]:
        """The tokens a row of `st` may not sample (counting `num_prior` proposals before a
        verifying row's position as output)."""
        params = st.sampling_params
        if len(st.output_token_ids) + num_prior >= params.min_tokens:
            return []
        if st.grammar is not None and st.grammar.is_stopped:
            return []  # a complete answer may only end: the grammar wins over min_tokens
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += st.eos_token_ids
        return banned

    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.banned_tokens is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        if metadata.banned_tokens is not None:
            rows, token_ids = metadata.banned_tokens
            logits[rows, token_ids] = float("-inf")


class Penalties:
    """Repetition (HF style, prompt or output), then frequency and presence (output)."""

    def applies(self, metadata: SamplingMetadata) -> bool:
        return has_penalties(metadata)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        apply_penalties(logits, metadata)


def has_penalties(m: SamplingMetadata) -> bool:
    """Whether any row of the batch asks a repetition, frequency or presence penalty."""
    return not (
        m.repetition_penalty is None and m.frequency_penalty is None and m.presence_penalty is None
    )


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Repetition (HF style, prompt or output), then frequency and presence (output), in place.

    Token counts come from one scatter_add over the padded id tensors; the pad id is
    vocab_size, so counts get one spare column that is dropped afterwards.
    """
    m = metadata
    if not has_penalties(m):
        return
    if m.output_token_ids is None:
        raise ValueError("penalties need output_token_ids (use SamplingMetadata.build).")
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(
        1, m.output_token_ids, torch.ones_like(m.output_token_ids, dtype=logits.dtype)
    )
    output_counts = output_counts[:, :vocab_size]
    output_seen = output_counts > 0

    if m.repetition_penalty is not None:
        if m.prompt_token_ids is None:
            raise ValueError(
                "repetition_penalty needs prompt_token_ids (use SamplingMetadata.build)."
            )
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, m.prompt_token_ids, True)
        seen = seen[:, :vocab_size] | output_seen
        penalty = m.repetition_penalty.unsqueeze(1).to(logits.dtype)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        torch.where(seen, penalised, logits, out=logits)
    if m.frequency_penalty is not None:
        logits.sub_(m.frequency_penalty.unsqueeze(1) * output_counts)
    if m.presence_penalty is not None:
        logits.sub_(m.presence_penalty.unsqueeze(1) * output_seen)


# In the order they apply (module docstring).
ROW_PROCESSORS: tuple[RowProcessor, ...] = (
    LogitBias(),
    AllowedTokens(),
    BadWords(),
    GrammarMask(),
    ThinkingBudgetEnd(),
)
SAMPLER_PROCESSORS: tuple[SamplerProcessor, ...] = (BannedTokens(), Penalties())
