"""Sampling for one step: rows to sample, their logits through the logits processors, the
sampler, logprobs, and the step's output packed for the core.

    choose_rows(inputs, so)     SampleRows: who samples, how many samples each (sample_rows.py)
    sample(rows, hidden)        logits rows -> ROW_PROCESSORS -> repeat -> Sampler
    pack(...)                   ModelRunnerOutput, one entry per sampling request
    prompt_logprobs(...)        for the prompt chunk just computed, if asked
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zllm.executor.host_to_device import take_rows, to_device
from zllm.executor.requests.state import RequestState
from zllm.executor.sample.logits_processors import ROW_PROCESSORS, BannedTokens, RowProcessor
from zllm.executor.sample.rows import ChildGenerators, SampleRows, choose_sample_rows
from zllm.executor.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from zllm.executor.step_inputs import StepInputs
from zllm.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput

# [N, hidden] -> [N, vocab] fp32 (ModelWeights.compute_logits)
ComputeLogits = Callable[[torch.Tensor], torch.Tensor]


class StepSampler:
    """Turns a step's hidden states into its sampled tokens and output."""

    def __init__(
        self,
        compute_logits: ComputeLogits,
        vocab_size: int,
        device: torch.device,
        unseeded_generator: torch.Generator | None = None,
        processors: Sequence[RowProcessor] = ROW_PROCESSORS,
    ) -> None:
        """`unseeded_generator`: what rows without a seed draw from (None: torch's global
        generator); tensor-parallel ranks pass one seeded alike, so their draws agree."""
        self.compute_logits = compute_logits
        self.vocab_size = vocab_size
        self.device = device
        self.unseeded_generator = unseeded_generator
        self.processors = tuple(processors)
        self.sampler = Sampler()
        self.child_generators: ChildGenerators = {}

    def choose_rows(self, inputs: StepInputs, so: SchedulerOutput) -> SampleRows:
        return choose_sample_rows(inputs, so, self.child_generators, self.device)

    def take_child_generator(self, parent_req_id: str, index: int) -> torch.Generator | None:
        """The generator sample `index` of `parent_req_id` drew its first token with."""
        return self.child_generators.pop((parent_req_id, index), None)

    def forget(self, req_id: str) -> None:
        """A finished request: the samples the core never forked (they finished at their
        first token) leave their generators."""
        for key in [key for key in self.child_generators if key[0] == req_id]:
            del self.child_generators[key]

    def sample(self, rows: SampleRows, hidden: torch.Tensor) -> SamplerOutput:
        """One token per sampler row; logits are computed once per logits row, then repeated
        for the samples of an n > 1 request."""
        logits = self.compute_logits(take_rows(hidden, rows.hidden_rows))
        for processor in self.processors:
            processor.apply(logits, rows)
        if len(rows.row_states) != len(rows.logits_states):
            repeats = to_device(rows.repeats, logits.device, torch.int64)
            # (output_size known here: else torch reads the repeats' sum from the device)
            logits = torch.repeat_interleave(
                logits, repeats, dim=0, output_size=len(rows.row_states)
            )
        pairs = list(zip(rows.row_states, rows.row_num_prior, strict=True))
        # A verifying row sees the proposals before it as output (penalties, min_tokens).
        outputs = [
            st.output_token_ids + rows.drafts[st.req_id][:prior] if prior else st.output_token_ids
            for st, prior in pairs
        ]
        metadata = SamplingMetadata.build(
            params=[st.sampling_params for st in rows.row_states],
            num_logprobs=[num_logprobs(st) for st in rows.row_states],
            generators=rows.row_generators,
            prompt_ids=[st.prompt_token_ids for st in rows.row_states],
            output_ids=outputs,
            banned=[BannedTokens.of(st, prior) for st, prior in pairs],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        metadata.unseeded_generator = self.unseeded_generator
        drafts = None
        if rows.verifies:
            drafts = to_device(rows.row_drafts, self.device, torch.int64)
        return self.sampler(logits, metadata, drafts)

    def pack(
        self,
        step_id: int,
        rows: SampleRows,
        sampled: SamplerOutput | None,
        prompt_logprobs: dict[str, LogprobsLists],
    ) -> ModelRunnerOutput:
        """One entry per sampling request: its sample(s), and their logprobs when asked; the
        tokens a request keeps are appended to its state.

        An n > 1 request keeps its first sample; the others go to the core, which forks them.
        A verifying request emits its accepted proposals and the token of the first row that
        did not accept (a correction, or the bonus token after all of them).
        """
        req_ids: list[str] = []
        tokens_per_req: list[list[int]] = []
        logprobs_per_req: list[LogprobsLists | None] = []
        if sampled is not None:
            tokens = sampled.sampled_token_ids.tolist()
            accepted = sampled.accepted.tolist() if sampled.accepted is not None else None
            row_logprobs = _row_logprobs(sampled, rows.row_states)
            first = 0
            for st, n in zip(rows.requests, rows.num_rows, strict=True):
                req_ids.append(st.req_id)
                if st.req_id in rows.drafts:
                    assert accepted is not None
                    used = next(j for j in range(n) if not accepted[first + j]) + 1
                    emitted = tokens[first : first + used]
                    for token in emitted:
                        st.append(token)
                else:
                    used = n
                    emitted = tokens[first : first + n]
                    if not st.sampling_params.use_beam_search:  # the core picks a beam's token
                        st.append(emitted[0])
                tokens_per_req.append(emitted)
                lps = row_logprobs[first : first + used]
                logprobs_per_req.append(_merge_rows(lps) if lps[0] is not None else None)
                first += n
        has_logprobs = any(lp is not None for lp in logprobs_per_req)
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=req_ids,
            sampled_token_ids=tokens_per_req,
            logprobs=logprobs_per_req if has_logprobs else [],
            prompt_logprobs=prompt_logprobs,
        )

    def prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given the ones before it, for the chunk just computed."""
        result: dict[str, LogprobsLists] = {}
        batch = zip(
            inputs.states, inputs.query_lens, inputs.seq_lens, inputs.token_ends, strict=True
        )
        for st, q, end, stop in batch:
            k = st.sampling_params.prompt_logprobs
            if k is None or st.output_token_ids:
                continue
            start = end - q
            # Position p predicts token p + 1; only positions whose next token is in the prompt.
            last = min(end, len(st.prompt_token_ids) - 1)
            if last <= start:
                continue
            rows = hidden[stop - q : stop - q + (last - start)]
            targets = to_device(st.prompt_token_ids[start + 1 : last + 1], self.device, torch.int64)
            # Pieces of equal size: a piece's row count picks its matmuls' arithmetic
            # (gguf_arithmetic.py), so no short last piece scores its positions otherwise.
            pieces = -(-rows.shape[0] // PROMPT_LOGPROB_ROWS)
            size = -(-rows.shape[0] // pieces)
            parts = []
            for i in range(0, rows.shape[0], size):
                logits = self.compute_logits(rows[i : i + size])
                parts.append(_scored_rows(logits, targets[i : i + size], k))
            ids, values, ranks = (torch.cat(column) for column in zip(*parts, strict=True))
            result[st.req_id] = LogprobsLists(
                token_ids=ids.tolist(), logprobs=values.tolist(), ranks=ranks.tolist()
            )
        return result


# A prompt's positions are scored at most this many at a time: their logits and log-probabilities
# ([rows, vocab] fp32 each) stay 134 MB at Gemma's 262,144-entry vocabulary, where a
# 2,048-token chunk's whole would be 2.1 GB twice over, and mostly in cache.
PROMPT_LOGPROB_ROWS = 128


def _scored_rows(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [rows, 1 + k]: each position's prompt token then its top k; their log-probs;
    the prompt token's rank), from the positions' logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_ids = (
        logprobs.topk(k, dim=1) if k > 0 else (chosen[:, :0], targets[:, None][:, :0])
    )
    return torch.cat([targets[:, None], top_ids], 1), torch.cat([chosen, top_vals], 1), ranks


def num_logprobs(st: RequestState) -> int | None:
    """Top logprobs a row returns: what the request asked for; a beam's candidates."""
    params = st.sampling_params
    if params.use_beam_search:
        return params.beam_candidates(len(st.eos_token_ids))
    return params.logprobs


def _row_logprobs(out: SamplerOutput, rows: list[RequestState]) -> list[LogprobsLists | None]:
    """Each sampler row's logprobs, cut to what its request asked for (None: nothing)."""
    if out.logprobs is None:
        return [None] * len(rows)
    assert out.logprobs_token_ids is not None and out.sampled_token_ranks is not None
    ids = out.logprobs_token_ids.tolist()
    lps = out.logprobs.tolist()
    ranks = out.sampled_token_ranks.tolist()
    result: list[LogprobsLists | None] = []
    for i, st in enumerate(rows):
        k = num_logprobs(st)
        if k is None:
            result.append(None)
        else:
            result.append(LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]]))
    return result


def _merge_rows(rows: list[LogprobsLists | None]) -> LogprobsLists:
    merged = LogprobsLists([], [], [])
    for row in rows:
        assert row is not None
        merged.extend(row)
    return merged
