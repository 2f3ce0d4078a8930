"""Which requests sample this step, and the sampler rows they fill."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from zllm.executor.requests.state import RequestState, make_generator
from zllm.executor.step_inputs import StepInputs
from zllm.protocol import SchedulerOutput

# Generators of the extra samples of an n > 1 request, drawn before the core's fork message
# for them arrives: (parent req_id, sample_index) -> generator.
ChildGenerators = dict[tuple[str, int], torch.Generator | None]


@dataclass(slots=True)
class SampleRows:
    """The requests that sample this step, and the sampler rows they fill (in batch order).

    A request drawing several samples (so.num_samples) fills that many rows with the same
    logits, one generator each. A request verifying d proposed tokens fills d + 1 rows, one
    per position, each with its own logits (row j: after the first j proposals):

        requests      |  a  |      b       |  c  |      d        |   b draws 3
        logits rows   |  a  |      b       |  c  | d0   d1   d2  |   d verifies 2 proposals
        sampler rows  |  a  |  b   b1  b2  |  c  | d0   d1   d2  |   b1, b2: samples 1, 2
    """

    requests: list[RequestState] = field(default_factory=list)
    # int64 [L]: the hidden-state row behind each logits row
    hidden_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    logits_states: list[RequestState] = field(default_factory=list)  # [L]
    repeats: list[int] = field(default_factory=list)  # [L]: sampler rows each logits row feeds
    num_rows: list[int] = field(default_factory=list)  # [R]: sampler rows of each request
    row_states: list[RequestState] = field(default_factory=list)  # [B]
    row_generators: list[torch.Generator | None] = field(default_factory=list)  # [B]
    row_drafts: list[int] = field(default_factory=list)  # [B]: proposal a row verifies, or -1
    # [B]: proposals before the row's position (0 unless verifying)
    row_num_prior: list[int] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # each verifier's proposals

    @property
    def verifies(self) -> bool:
        return bool(self.drafts)

    def add_verifier(self, st: RequestState, drafts: list[int], token_end: int) -> list[int]:
        """d + 1 rows of their own logits for a request verifying d proposals; returns the
        hidden rows they read."""
        self.drafts[st.req_id] = drafts
        num = len(drafts) + 1
        self.logits_states.extend([st] * num)
        self.repeats.extend([1] * num)
        self.num_rows.append(num)
        self.row_states.extend([st] * num)
        self.row_generators.extend([st.generator] * num)
        self.row_drafts.extend([*drafts, -1])
        self.row_num_prior.extend(range(num))
        return list(range(token_end - num, token_end))

    def add_samples(self, st: RequestState, generators: list[torch.Generator | None]) -> None:
        """One logits row feeding a sampler row per generator (an n > 1 request's samples)."""
        n = len(generators)
        self.logits_states.append(st)
        self.repeats.append(n)
        self.num_rows.append(n)
        self.row_states.extend([st] * n)
        self.row_drafts.extend([-1] * n)
        self.row_num_prior.extend([0] * n)
        self.row_generators.extend(generators)


def choose_sample_rows(
    inputs: StepInputs,
    so: SchedulerOutput,
    child_generators: ChildGenerators,
    device: torch.device,
) -> SampleRows:
    """Every request whose known tokens (and proposals) are all computed after this step
    samples; one named in num_samples (an n > 1 request at its first token, the scheduler
    decides) draws that many samples from the same logits, and one with proposals
    (so.spec_token_ids) verifies them, a logits row per position. Sample i > 0 draws with its
    own seeded generator, parked in `child_generators` until the core's fork message for it
    arrives."""
    if not so.spec_token_ids and not so.num_samples:
        return _one_row_each(inputs)
    return _row_by_row(inputs, so, child_generators, device)


def _samples(st: RequestState, end: int, num_drafts: int) -> bool:
    """Whether `st` samples in a step whose context ends at `end`: all its known tokens
    (pending ones included: sampled, still on the device) and its proposals are computed,
    and it is not an embeddings request."""
    known = len(st.all_token_ids) + st.num_pending
    return end == known + num_drafts and not st.sampling_params.embed


def _row_by_row(
    inputs: StepInputs,
    so: SchedulerOutput,
    child_generators: ChildGenerators,
    device: torch.device,
) -> SampleRows:
    """choose_sample_rows, one request at a time: proposals and n > 1 draws included."""
    rows = SampleRows()
    hidden_rows: list[int] = []
    batch = zip(inputs.states, inputs.seq_lens, inputs.token_ends, strict=True)
    for st, end, token_end in batch:
        drafts = so.spec_token_ids.get(st.req_id, [])
        if not _samples(st, end, len(drafts)):
            continue
        rows.requests.append(st)
        if drafts:
            hidden_rows.extend(rows.add_verifier(st, drafts, int(token_end)))
            continue
        generators = [st.generator]
        for index in range(1, so.num_samples.get(st.req_id, 1)):
            generator = make_generator(st.sampling_params.seed, index, device)
            child_generators[(st.req_id, index)] = generator
            generators.append(generator)
        hidden_rows.append(int(token_end) - 1)
        rows.add_samples(st, generators)
    rows.hidden_rows = np.asarray(hidden_rows, dtype=np.int64)
    return rows


def _one_row_each(inputs: StepInputs) -> SampleRows:
    """choose_sample_rows for a step without proposals or n > 1 draws (most steps): each
    sampling request fills one logits row and one sampler row, so every list is built in
    one pass instead of row by row (a quarter of a millisecond of host time at 256 rows)."""
    batch = zip(inputs.states, inputs.seq_lens, inputs.token_ends, strict=True)
    picked = [(st, int(token_end) - 1) for st, end, token_end in batch if _samples(st, end, 0)]
    states = [st for st, _ in picked]
    count = len(states)
    return SampleRows(
        requests=states,
        hidden_rows=np.asarray([row for _, row in picked], dtype=np.int64),
        logits_states=list(states),
        repeats=[1] * count,
        num_rows=[1] * count,
        row_states=list(states),
        row_generators=[st.generator for st in states],
        row_drafts=[-1] * count,
        row_num_prior=[0] * count,
    )
