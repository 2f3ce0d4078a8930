"""Vectorised token sampler: one set of tensor ops for every row that samples this step.

Order of operations (vLLM semantics):

    raw logits ──► logprobs (log_softmax, fp32)            kept aside for the output
        │
        ▼ fp32 copy
    banned tokens → -inf ─► penalties ─┬─► argmax ─────────────────────────────┐
                                       │                                       ├─► where(greedy)
                                       └─► ÷ temperature ─► min-p ─► top-k/p ─► race
                                                                                ┘

"race" is the exponential race: argmax(probs / q) with q ~ Exp(1) draws a token with
probability proportional to probs, so sampling is one elementwise divide plus an argmax and
seeded rows only need their own q row drawn from their own generator.

Speculative decoding verifies proposed tokens by rejection sampling against the same
distribution. Proposals are deterministic (n-gram lookup, a draft model's argmax), so the
proposal distribution q is one-hot at the proposed token d, and the rule "accept d with
probability min(1, p(d) / q(d)), else draw from max(0, p - q) renormalised" becomes: accept
d with probability p(d), else draw from p with d removed. The output is then distributed
exactly as p: P(d) = p(d), and P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t) for t != d. A
greedy row accepts d when it is the argmax. (The race needs no renormalisation.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from zllm.executor.host_to_device import to_device
from zllm.executor.sample.logits_processors import SAMPLER_PROCESSORS, SamplerProcessor
from zllm.sampling_params import SamplingParams

# Rows with temperature below this are greedy (same threshold as SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings as batch tensors; a field is None when no row uses it."""

    temperature: torch.Tensor  # float32 [B]; 0 means greedy for that row
    top_k: torch.Tensor | None  # int64 [B], 0 = disabled
    max_top_k: int  # the largest of top_k (known on the host: no wait for the device)
    top_p: torch.Tensor | None  # float32 [B], 1.0 = disabled
    min_p: torch.Tensor | None  # float32 [B], 0 = disabled
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator]  # row -> generator, for rows with a seed
    presence_penalty: torch.Tensor | None  # float32 [B], 0 = disabled
    frequency_penalty: torch.Tensor | None  # float32 [B], 0 = disabled
    repetition_penalty: torch.Tensor | None  # float32 [B], 1 = disabled
    prompt_token_ids: torch.Tensor | None  # int64 [B, Lp], padded with vocab_size
    output_token_ids: torch.Tensor | None  # int64 [B, Lo], padded with vocab_size
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows [K], token ids [K])
    max_num_logprobs: int | None  # None: no row wants logprobs
    # Rows without a seed draw from this (None: torch's global generator). Tensor-parallel
    # ranks each hold one seeded alike, so their draws agree whatever else uses the global
    # one in their processes.
    unseeded_generator: torch.Generator | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        banned: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        num_logprobs: list[int | None] | None = None,
    ) -> SamplingMetadata:
        """Gather per-request settings into tensors, leaving unused features as None.

        `prompt_ids`/`output_ids` are read only when a row uses a penalty that needs them.
        """
        _check_one_per_row(params, generators, prompt_ids, output_ids, banned)
        greedy = [p.greedy for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, device, torch.float32)

        temperature = floats([0.0 if p.greedy else p.temperature for p in params])
        # top_k >= vocab_size keeps every token, the same as disabled.
        top_k_values = [p.top_k if p.top_k < vocab_size else 0 for p in params]
        top_k = None
        if any(top_k_values):
            top_k = to_device(top_k_values, device, torch.int64)
        top_p = floats([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None
        min_p = floats([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None

        penalties = _penalty_tensors(params, prompt_ids, output_ids, vocab_size, device)
        # Top logprobs per row: each request's own, unless given (beam search's candidates).
        wanted = num_logprobs if num_logprobs is not None else [p.logprobs for p in params]
        requested = [k for k in wanted if k is not None]
        return cls(
            temperature=temperature,
            top_k=top_k,
            max_top_k=max(top_k_values),
            top_p=top_p,
            min_p=min_p,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            generators={
                row: g for row, g in enumerate(generators) if g is not None and not greedy[row]
            },
            presence_penalty=penalties.presence,
            frequency_penalty=penalties.frequency,
            repetition_penalty=penalties.repetition,
            prompt_token_ids=penalties.prompt_token_ids,
            output_token_ids=penalties.output_token_ids,
            banned_tokens=_banned_tokens(banned, device),
            max_num_logprobs=max(requested) if requested else None,
        )


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    # Present only when max_num_logprobs is not None; k = max_num_logprobs (capped at vocab).
    logprobs_token_ids: torch.Tensor | None  # int64 [B, k+1]: sampled token, then top-k ids
    logprobs: torch.Tensor | None  # float32 [B, k+1], raw log_softmax values
    sampled_token_ranks: torch.Tensor | None  # int64 [B]: 1 = most likely token
    # With draft_token_ids: bool [B], whether the row accepted its proposed token (then
    # sampled_token_ids holds it); a row that did not is where its sequence's step ends.
    accepted: torch.Tensor | None = None


class Sampler(torch.nn.Module):
    def __init__(self, processors: Sequence[SamplerProcessor] = SAMPLER_PROCESSORS) -> None:
        """`processors`: edit the fp32 logits before the draw (logits_processors.py)."""
        super().__init__()
        self.processors = tuple(processors)

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]; the input tensor is not modified.

        `draft_token_ids` (int64 [B], -1 where a row has none): verify each row's proposed
        token by rejection sampling (module docstring) instead of drawing freely."""
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        active = [p for p in self.processors if p.applies(metadata)]
        # A copy only where something will edit the logits (a ban, a penalty, a random draw):
        # a greedy batch without them reads them as they are (a [B, 262k] copy is ~2.4 ms
        # at B=16 on one core).
        if active or not metadata.all_greedy or logits.dtype != torch.float32:
            logits = logits.to(torch.float32, copy=True)
        for processor in active:
            processor.apply(logits, metadata)

        greedy_ids = None if metadata.all_random else first_max_index(logits)
        accepted = None
        if draft_token_ids is not None:
            sampled, accepted = verify_drafts(logits, greedy_ids, metadata, draft_token_ids)
        elif metadata.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = sample_random(logits, metadata)
            if greedy_ids is None:
                sampled = random_ids
            else:
                is_greedy = metadata.temperature < GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, greedy_ids, random_ids)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None, accepted)
        token_ids, logprobs, ranks = gather_logprobs(
            raw_logprobs, sampled, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled, token_ids, logprobs, ranks, accepted)


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dimension: `torch.max`'s indices, the same first index
    `argmax` gives (ties, NaN; tested), in a third of its time on CPU over a vocabulary
    (0.13 against 0.40 ms a 262k row on one core)."""
    return x.max(dim=-1).indices


def verify_drafts(
    logits: torch.Tensor,
    greedy_ids: torch.Tensor | None,
    metadata: SamplingMetadata,
    draft_token_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of one-hot proposals (module docstring): per row, (the token it
    emits, whether that is its accepted proposal). A row without a proposal (-1) samples
    freely and counts as not accepted. `logits` have bans and penalties applied; modified."""
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)
    if metadata.all_greedy:
        assert greedy_ids is not None
        accepted = has_draft & (greedy_ids == drafts)
        return torch.where(accepted, drafts, greedy_ids), accepted
    probs = processed_probs(logits, metadata)  # temperature, min-p, top-k/p: what p is
    draft_probs = probs.gather(1, drafts[:, None]).squeeze(1)
    uniform = torch.empty_like(draft_probs)
    if len(metadata.generators) < uniform.shape[0]:
        uniform.uniform_(generator=metadata.unseeded_generator)
    for row, generator in metadata.generators.items():
        uniform[row : row + 1].uniform_(generator=generator)
    accepted = has_draft & (uniform < draft_probs)
    # The residual distribution: p without the rejected proposal (renormalising is implicit).
    residual = probs.scatter(1, drafts[:, None], torch.where(has_draft, 0.0, draft_probs)[:, None])
    sampled = torch.where(
        accepted,
        drafts,
        exponential_race(residual, metadata.generators, metadata.unseeded_generator),
    )
    if greedy_ids is not None:
        is_greedy = metadata.temperature < GREEDY_TEMPERATURE
        greedy_accepted = has_draft & (greedy_ids == drafts)
        accepted = torch.where(is_greedy, greedy_accepted, accepted)
        sampled = torch.where(is_greedy, torch.where(greedy_accepted, drafts, greedy_ids), sampled)
    return sampled, accepted


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k/top-p, then the exponential race; modifies `logits`.

    Greedy rows in a mixed batch go through with temperature 1 and are discarded later.
    """
    return exponential_race(
        processed_probs(logits, metadata), metadata.generators, metadata.unseeded_generator
    )


def processed_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: temperature, min-p, top-k/top-p, softmax;
    modifies `logits`. Greedy rows in a mixed batch get temperature 1."""
    m = metadata
    temperature = m.temperature
    if not m.all_random:
        temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(temperature.unsqueeze(1))
    if m.min_p is not None:
        apply_min_p(logits, m.min_p)
    if m.top_k is not None or m.top_p is not None:
        apply_top_k_top_p(logits, m.top_k, m.top_p, m.max_top_k)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob, in place.

    In logit space that is logit < max logit + log(min_p), which needs no softmax;
    min_p = 0 gives log 0 = -inf and drops nothing.
    """
    threshold = logits.amax(dim=-1) + torch.log(min_p)
    logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> None:
    """Keep each row's top-k, then its top-p nucleus of what is left, in place. `max_top_k`:
    the largest of top_k (read from the device when 0).

    Both filters keep a prefix of the row sorted by value, so each reduces to a per-row
    threshold value and the row keeps logits >= the larger of the two thresholds (ties at
    the threshold are kept). Top-k alone uses torch.topk up to the largest k; top-p needs
    one full descending sort shared with top-k.
    """
    num_rows, vocab_size = logits.shape
    neg_inf = float("-inf")
    if top_p is None:
        assert top_k is not None
        max_k = min(max_top_k or int(top_k.max().item()), vocab_size)
        if max_k == 0:
            return
        top_values = logits.topk(max_k, dim=-1).values
        kth = (top_k.clamp(1, max_k) - 1).unsqueeze(1)
        threshold = top_values.gather(1, kth).squeeze(1)
        threshold = torch.where(top_k > 0, threshold, neg_inf)
        logits.masked_fill_(logits < threshold.unsqueeze(1), neg_inf)
        return

    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = torch.full((num_rows,), neg_inf, dtype=logits.dtype, device=logits.device)
    if top_k is not None:
        kth = (top_k.clamp(1, vocab_size) - 1).unsqueeze(1)
        top_k_threshold = sorted_logits.gather(1, kth).squeeze(1)
        threshold = torch.where(top_k > 0, top_k_threshold, threshold)
        # Top-p looks at the probabilities renormalised over the top-k survivors.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold.unsqueeze(1), neg_inf)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Smallest prefix whose mass reaches p: every token whose running total is still below
    # p, plus the one that crosses it. Never empty, since p > 0.
    num_keep = ((cumulative < top_p.unsqueeze(1)).sum(dim=-1) + 1).clamp(max=vocab_size)
    top_p_threshold = sorted_logits.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
    # p = 1 keeps everything, even tokens that a float32 cumsum already counts as 1.0.
    top_p_threshold = torch.where(top_p < 1.0, top_p_threshold, neg_inf)
    threshold = torch.maximum(threshold, top_p_threshold)
    logits.masked_fill_(logits < threshold.unsqueeze(1), neg_inf)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    unseeded: torch.Generator | None = None,
) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a draw from each row's distribution.

    A seeded row draws its whole q row from its own generator, so its tokens do not depend
    on which other rows share the batch. q is floored at the smallest normal float so a
    zero draw cannot turn a masked token's 0/0 into a NaN that argmax would pick.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=unseeded)
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return first_max_index(probs.div_(q))


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled token's logprob and rank, plus the top-`num_logprobs` tokens, per row.

    Column layout of the [B, k+1] outputs: | sampled | top-1 | top-2 | ... | top-k |
    """
    num_logprobs = min(num_logprobs, raw_logprobs.shape[-1])
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = raw_logprobs.gather(1, sampled)
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    token_ids = torch.cat([sampled, top_ids], dim=1)
    logprobs = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return token_ids, logprobs, ranks


def _check_one_per_row(*per_row: list) -> None:
    """params, generators, prompt_ids, output_ids and banned: one entry per row each."""
    if len({len(values) for values in per_row}) > 1:
        raise ValueError(
            "params, generators, prompt_ids, output_ids and banned must have one entry per "
            f"row; got lengths {', '.join(str(len(values)) for values in per_row)}."
        )


class _PenaltyTensors(NamedTuple):
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None


def _penalty_tensors(
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> _PenaltyTensors:
    """The penalties as batch tensors, each None when no row uses it; the token ids only where
    a penalty in use reads them (repetition: prompt and output; the others: output)."""
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    use_presence = any(presence)
    use_frequency = any(frequency)
    use_repetition = any(r != 1.0 for r in repetition)

    def floats(values: list[float]) -> torch.Tensor:
        return to_device(values, device, torch.float32)

    reads_output = use_presence or use_frequency or use_repetition
    return _PenaltyTensors(
        presence=floats(presence) if use_presence else None,
        frequency=floats(frequency) if use_frequency else None,
        repetition=floats(repetition) if use_repetition else None,
        prompt_token_ids=(
            _pad_token_ids(prompt_ids, vocab_size, device) if use_repetition else None
        ),
        output_token_ids=(_pad_token_ids(output_ids, vocab_size, device) if reads_output else None),
    )


def _banned_tokens(
    banned: list[list[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [K], token ids [K]) of every row's banned tokens; None when there are none."""
    banned_pairs = [(row, tok) for row, toks in enumerate(banned) for tok in toks]
    if not banned_pairs:
        return None
    pairs = to_device(banned_pairs, device, torch.int64)
    return pairs[:, 0], pairs[:, 1]


def _pad_token_ids(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, L] int64, right-padded with vocab_size, an id no real token has."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = np.full((len(token_ids), max_len), vocab_size, dtype=np.int64)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = ids
    return to_device(padded, device)
