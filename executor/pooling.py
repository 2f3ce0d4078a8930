"""Embeddings requests: a prompt's final hidden states pooled into one vector, as the model's
pooler says (zllm/config/pooler.py: the mean, the last token's or the first's; normalised or
not); a classifier's vector is its labels' probabilities, its head over the pooled state
(a decoder's score rows over the last token's, an encoder's head over its [CLS])."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.config.pooler import PoolerConfig
from zllm.executor.step_inputs import StepInputs


def pool_embeddings(
    inputs: StepInputs,
    hidden: torch.Tensor,
    pooler: PoolerConfig,
    classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, list[float]]:
    """Each embeddings request's vector once its prompt is complete. Its chunks' final hidden
    states are summed as they come (mean), or the first token's kept (cls), or the last
    chunk's last row taken (last); a chunk starting at position 0 starts over (a recompute
    after preemption). `classify`: a classifier's head, the pooled state -> its logits."""
    if pooler.labels and classify is None:
        raise RuntimeError("a classifier's pooler without the model's head")
    pooled: dict[str, list[float]] = {}
    batch = zip(inputs.states, inputs.query_lens, inputs.seq_lens, inputs.token_ends, strict=True)
    for st, q, end, stop in batch:
        if not st.sampling_params.embed:
            continue
        rows = hidden[stop - q : stop].float()
        if end - q == 0 or st.pool_sum is None:
            first = rows[0] if pooler.pooling == "cls" else torch.zeros_like(rows[0])
            st.pool_sum = first.clone()
        if pooler.pooling == "mean":
            st.pool_sum += rows.sum(dim=0)
        if end < len(st.all_token_ids):
            continue
        if pooler.pooling == "mean":
            vector = st.pool_sum / end
        else:
            vector = rows[-1] if pooler.pooling == "last" else st.pool_sum
        if classify is not None:
            vector = label_probabilities(classify(vector).float())
        elif pooler.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        pooled[st.req_id] = vector.tolist()
        st.pool_sum = None
    return pooled


def label_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's logits as probabilities: softmax over its labels; one label (a
    cross-encoder's or reranker's relevance) a sigmoid score, as transformers' pipelines and
    sentence-transformers' CrossEncoder read them."""
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=0)
