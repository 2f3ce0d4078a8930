"""executor/sample/rows.py: a step without proposals or n > 1 draws takes a one-pass path
(`_one_row_each`); it must choose exactly the rows the general row-by-row path chooses:
requests whose tokens are all computed after the step (a pending token counts), not a
prompt's unfinished chunk, not an embeddings request."""

from __future__ import annotations

import numpy as np
import torch

from zllm.executor.requests.state import RequestState
from zllm.executor.sample.rows import _one_row_each, _row_by_row
from zllm.executor.step_inputs import StepInputs
from zllm.protocol import SchedulerOutput
from zllm.sampling_params import SamplingParams


def state(req_id: str, prompt: int, output: int, params: SamplingParams, pending: int = 0):
    st = RequestState(
        req_id=req_id, prompt_token_ids=list(range(prompt)), output_token_ids=[7] * output,
        sampling_params=params, block_ids=[[0]], num_computed_tokens=0, eos_token_ids=[2],
        generator=torch.Generator().manual_seed(len(req_id)),
    )  # fmt: skip
    st.num_pending = pending
    return st


def test_the_one_pass_path_chooses_what_the_row_by_row_path_chooses():
    plain, embed = SamplingParams(max_tokens=8), SamplingParams(max_tokens=1)
    embed.embed = True
    # (state, tokens in context after the step, new tokens this step)
    batch = [
        (state("decode", 10, 3, plain), 13, 1),
        (state("chunk", 40, 0, plain), 24, 24),  # a prompt's first 24 of 40: no sample
        (state("prompt-end", 40, 0, plain), 40, 16),
        (state("pending", 10, 2, plain, pending=1), 13, 1),  # its last token on the device
        (state("embedding", 12, 0, embed), 12, 12),
        (state("decode-2", 5, 9, plain), 14, 1),
    ]
    query_lens = [q for _, _, q in batch]
    inputs = StepInputs(
        states=[st for st, _, _ in batch], query_lens=query_lens,
        seq_lens=[end for _, end, _ in batch], token_ends=np.cumsum(query_lens),
        input_ids=torch.zeros(sum(query_lens), dtype=torch.int64),
        positions=torch.zeros(sum(query_lens), dtype=torch.int64), attn_metadata=None,
    )  # fmt: skip
    so = SchedulerOutput(step_id=1, new_requests=[], cached_requests=[],
                         num_scheduled_tokens={st.req_id: q for st, _, q in batch},
                         total_num_scheduled_tokens=sum(query_lens))  # fmt: skip
    fast = _one_row_each(inputs)
    general = _row_by_row(inputs, so, {}, torch.device("cpu"))
    assert [st.req_id for st in fast.requests] == ["decode", "prompt-end", "pending", "decode-2"]
    for name in ("requests", "logits_states", "repeats", "num_rows", "row_states",
                 "row_generators", "row_drafts", "row_num_prior", "drafts"):  # fmt: skip
        assert getattr(fast, name) == getattr(general, name), name
    assert fast.hidden_rows.tolist() == general.hidden_rows.tolist() == [0, 40, 41, 54]
