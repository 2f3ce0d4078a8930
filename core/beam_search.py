"""Beam search over the engine's sequences: which beams continue, which hypotheses finish.

A beam-search request runs as up to `beam_width` sequences (core Requests) in lockstep. Each
step every running beam reports its top candidate next tokens with their log-probabilities
(the executor's logprobs, `SamplingParams.beam_candidates` of them); once all have reported, `select`
picks the round's outcome exactly as transformers' `generate(num_beams=k, do_sample=False)`
does, so the best hypothesis matches it:

    candidates    every (beam, token) scored cum_logprob(beam) + logprob(token); the best
                  max(2, 1 + number of EOS ids) x k of them, best first
    finished      those among the first k that end (an EOS id, or the length limit), scored
                  cum / generated_length ** length_penalty; the best k hypotheses are kept
    running       the best k candidates that do not end
    stop          no running beam could beat the worst of k finished hypotheses (the
                  heuristic at the current length; `early_stopping`: as soon as k finished;
                  "never": at the longest length when length_penalty > 0), or none runs on

The scheduler applies a round: a beam continued by one candidate appends its token, one
continued by several forks (blocks shared, copy-on-write), one continued by none is freed.
This module holds only the arithmetic and the bookkeeping; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zllm.core.request import Request
from zllm.protocol import FinishReason
from zllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # output tokens, the final one included (an EOS id too)
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: FinishReason


@dataclass(slots=True)
class Continuation:
    """A running beam of the next round: `parent` (a running beam now) extended by `token`."""

    parent: Request
    token: int
    cum_logprob: float


@dataclass(slots=True)
class Round:
    continuations: list[Continuation]
    done: bool


@dataclass(slots=True)
class BeamGroup:
    """One beam-search request: its running beams and finished hypotheses."""

    params: SamplingParams
    eos_token_ids: list[int]
    max_new_tokens: int  # max_tokens, or what the context length leaves
    running: list[tuple[Request, float]] = field(default_factory=list)  # beam, cum logprob
    finished: list[Hypothesis] = field(default_factory=list)  # best first
    # Candidates of this round per running beam: (token, logprob), best first.
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    improvement_possible: bool = True
    next_fork: int = 1  # for naming forked beams

    @property
    def width(self) -> int:
        return self.params.num_beams

    def report(self, req_id: str, candidates: list[tuple[int, float]]) -> bool:
        """Store one beam's candidates (a repeat after a recompute is ignored); True once
        every running beam has reported."""
        if any(beam.req_id == req_id for beam, _ in self.running):
            self.reports.setdefault(req_id, candidates)
        return len(self.reports) == len(self.running)

    def select(self) -> Round:
        """The round's outcome once every running beam has reported (module docstring)."""
        k, lp = self.width, self.params.length_penalty
        stop_ids = set() if self.params.ignore_eos else set(self.eos_token_ids)
        scored = []
        for order, (beam, cum) in enumerate(self.running):
            for rank, (token, logprob) in enumerate(self.reports[beam.req_id]):
                scored.append((cum + logprob, order, rank, beam, token))
        # Best first; ties by beam order then token rank (transformers' flattened top-k).
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = scored[: self.params.beam_candidates(len(self.eos_token_ids))]
        length = self.running[0][0].num_output_tokens + 1  # generated, this token included
        at_limit = length >= self.max_new_tokens
        continuations: list[Continuation] = []
        new_finished: list[Hypothesis] = []
        for position, (cum, _, _, beam, token) in enumerate(top):
            ends = at_limit or token in stop_ids
            if not ends:
                if len(continuations) < k:
                    continuations.append(Continuation(beam, token, cum))
            elif position < k and self._may_add():
                new_finished.append(
                    Hypothesis(
                        [*beam.output_token_ids, token],
                        cum,
                        cum / length**lp,
                        FinishReason.STOP if token in stop_ids else FinishReason.LENGTH,
                    )
                )
        if new_finished:
            merged = sorted(self.finished + new_finished, key=lambda h: -h.score)
            self.finished = merged[:k]
        self.reports = {}
        if continuations:
            self._update_heuristic(continuations[0].cum_logprob, length)
        done = (
            not continuations
            or not self.improvement_possible
            or (self.params.early_stopping is True and len(self.finished) >= k)
        )
        return Round(continuations, done)

    def _may_add(self) -> bool:
        """transformers adds no hypothesis once improvement is impossible, nor, with
        early_stopping, once k are finished."""
        full = len(self.finished) >= self.width
        return self.improvement_possible and not (self.params.early_stopping is True and full)

    def _update_heuristic(self, best_running_cum: float, length: int) -> None:
        """Could the best running beam still beat the worst of k finished hypotheses?"""
        if len(self.finished) < self.width:
            return  # a free slot: any finished hypothesis still improves the set
        lp = self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0.0:
            length = self.max_new_tokens  # the most a longer beam could be divided by
        best_possible = best_running_cum / length**lp
        self.improvement_possible = best_possible > min(h.score for h in self.finished)

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
