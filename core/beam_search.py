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

`BeamCoordinator` applies a round for the scheduler: a beam continued by one candidate
appends its token, one continued by several forks (blocks shared, copy-on-write), one
continued by none is freed. The scheduler asks it which beams are idle (reported, waiting
for their siblings: preempted first, passed over in the queue) and hands it each beam's
report; the coordinator asks the scheduler back only to name, adopt and end sequences.
This module holds only the arithmetic and the bookkeeping; no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zllm.core.request import Request, child_request_id
from zllm.core.step.outputs import queue_time
from zllm.protocol import EngineCoreOutput, FinishReason, ForkedRequestData, LogprobsLists
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


class BeamCoordinator:
    """The beam-search requests of one scheduler: their groups, and the tokens chosen for
    running beams that the next step sends the executor (SchedulerOutput.beam_tokens).

    `is_taken(req_id)`: whether a sequence id is in use. `adopt(parent, child, fork)`: a
    forked beam joins its parent's client request (shares its blocks, or recomputes when the
    parent is preempted) and the executor is told of it. `end(req, reason)`: a sequence
    ends (its blocks are freed).
    """

    def __init__(
        self,
        is_taken: Callable[[str], bool],
        adopt: Callable[[Request, Request, ForkedRequestData], None],
        end: Callable[[Request, FinishReason], None],
    ) -> None:
        self._is_taken = is_taken
        self._adopt = adopt
        self._end = end
        self.groups: dict[str, BeamGroup] = {}  # client request id -> its group
        self._pending_tokens: dict[str, int] = {}  # beam id -> its next token

    def add(self, req: Request, max_model_len: int) -> None:
        """A new beam-search request: its group, with `req` as the one running beam."""
        params = req.sampling_params
        room = max_model_len - req.num_prompt_tokens
        self.groups[req.client_req_id] = BeamGroup(
            params,
            req.eos_token_ids,
            max_new_tokens=min(params.max_tokens or room, room),
            running=[(req, 0.0)],
        )

    def drop(self, client_req_id: str) -> None:
        """The request is gone (aborted, failed): its beams are ended by the scheduler."""
        self.groups.pop(client_req_id, None)

    def forget(self, req_id: str) -> None:
        """A beam ended: its chosen token, if not yet sent, is not sent."""
        self._pending_tokens.pop(req_id, None)

    def take_tokens(self) -> dict[str, int]:
        """The tokens chosen for running beams since the last step (every stage gets them)."""
        tokens, self._pending_tokens = self._pending_tokens, {}
        return tokens

    def is_idle(self, req: Request) -> bool:
        """A beam that has reported this round and has no token yet to compute."""
        group = self.groups.get(req.client_req_id)
        return group is not None and req.req_id in group.reports

    def idle_beam(self, running: list[Request], scheduled: list[Request]) -> Request | None:
        """The newest running beam that waits for its siblings and is not in this step: the
        first to preempt (its report is kept). Without this, beams holding blocks while a
        preempted sibling waits for blocks would wait forever."""
        return next((r for r in reversed(running) if self.is_idle(r) and r not in scheduled), None)

    def report(self, req: Request, logprobs: LogprobsLists) -> list[EngineCoreOutput]:
        """A beam's candidates (the top logprobs after the sampled token); once every beam of
        its group has reported, the round is applied. Returns the outputs of a group that
        finished (its best hypotheses, one each)."""
        group = self.groups.get(req.client_req_id)
        if group is None:
            return []
        candidates = list(zip(logprobs.token_ids[0][1:], logprobs.logprobs[0][1:], strict=True))
        if not group.report(req.req_id, candidates):
            return []
        round_ = group.select()
        if round_.done:
            return self._finish_group(group)
        self._apply_round(group, round_.continuations)
        return []

    def _apply_round(self, group: BeamGroup, continuations: list[Continuation]) -> None:
        """Continue each running beam by its candidates: the first appends its token, more
        fork, none ends it."""
        first_child: dict[str, int] = {}  # parent id -> its first continuation's index
        for i, c in enumerate(continuations):
            first_child.setdefault(c.parent.req_id, i)
        for parent, _ in group.running:
            if parent.req_id not in first_child:
                self._end(parent, FinishReason.STOP)
        # Forks copy their parent before it takes its own token.
        beams = [
            c.parent if first_child[c.parent.req_id] == i else self._fork(group, c)
            for i, c in enumerate(continuations)
        ]
        for i, c in enumerate(continuations):
            if first_child[c.parent.req_id] == i:
                c.parent.append_token(c.token)
                self._pending_tokens[c.parent.req_id] = c.token
                c.parent.num_tokens_sent += 1  # every stage gets it (beam_tokens)
        # Best first, as transformers keeps its beams (ties in the next round follow it).
        group.running = [
            (beam, c.cum_logprob) for beam, c in zip(beams, continuations, strict=True)
        ]

    def _fork(self, group: BeamGroup, c: Continuation) -> Request:
        parent, token = c.parent, c.token
        index = group.next_fork
        group.next_fork += 1
        child = parent.fork(
            child_request_id(parent.req_id, index, self._is_taken),
            sample_index=0,
            output_token_ids=[*parent.output_token_ids, token],
            num_computed_tokens=parent.num_computed_tokens,
            status=parent.status,
        )
        child.first_scheduled_time = parent.first_scheduled_time
        child.known_to_executor = True
        child.num_tokens_sent = child.num_tokens  # the fork gives every stage its tokens
        fork = ForkedRequestData(
            req_id=child.req_id,
            parent_req_id=parent.req_id,
            sample_index=0,
            first_token_id=token,
            num_parent_outputs=parent.num_output_tokens,
        )
        self._adopt(parent, child, fork)
        return child

    def _finish_group(self, group: BeamGroup) -> list[EngineCoreOutput]:
        """The search is over: its best hypotheses, one output each; its beams end."""
        first = group.running[0][0] if group.running else None
        outputs = []
        for index, hyp in enumerate(group.best(group.params.n)):
            out = EngineCoreOutput(
                req_id=first.client_req_id if first else "",
                sample_index=index,
                new_token_ids=hyp.token_ids,
                finish_reason=hyp.finish_reason,
                num_prompt_tokens=first.num_prompt_tokens if first else 0,
                num_cached_tokens=max(first.num_cached_tokens, 0) if first else 0,
                cumulative_logprob=hyp.cum_logprob,
            )
            out.queue_time_s = queue_time(first) if first else 0.0
            outputs.append(out)
        for beam, _ in group.running:
            self._end(beam, FinishReason.STOP)
        if first is not None:
            self.groups.pop(first.client_req_id, None)
        return outputs
