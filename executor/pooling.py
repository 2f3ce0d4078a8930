"""Embeddings requests: a prompt's final hidden states pooled into one vector."""

from __future__ import annotations

import torch

from zllm.executor.step_inputs import StepInputs


def pool_embeddings(
    inputs: StepInputs, hidden: torch.Tensor, pooling: str
) -> dict[str, list[float]]:
    """Sum each embeddings request's final hidden states chunk by chunk; when the prompt is
    complete, its vector (mean or last token, `pooling`), L2-normed. A chunk starting at
    position 0 starts the sum over (a recompute after preemption)."""
    pooled: dict[str, list[float]] = {}
    batch = zip(inputs.states, inputs.query_lens, inputs.seq_lens, inputs.token_ends, strict=True)
    for st, q, end, stop in batch:
        if not st.sampling_params.embed:
            continue
        rows = hidden[stop - q : stop].float()
        if end - q == 0 or st.pool_sum is None:
            st.pool_sum = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        st.pool_sum += rows.sum(dim=0)
        if end < len(st.all_token_ids):
            continue
        vector = st.pool_sum / end if pooling == "mean" else rows[-1]
        pooled[st.req_id] = torch.nn.functional.normalize(vector, dim=0).tolist()
        st.pool_sum = None
    return pooled
