"""A step's inputs: the scheduled requests' new tokens as one flat batch, with their positions
and the attention metadata of every (KV cache group, window) the layers use.

A request's new tokens are positions [computed, computed + scheduled) of its known tokens,
so a prompt chunk, a decode and a pending token are all the same case:

    requests     |      a (prompt chunk)     | b | c (verifies 2) |
    input_ids    | a4  a5  a6  a7  a8  a9    | b | c  d1  d2      |   d1, d2: proposals
    positions    | 4   5   6   7   8   9     | 30| 17 18  19      |
    token_ends   |                       6   | 7 |            10  |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from zllm.executor.attention.backend import StepAttentionMetadata
from zllm.executor.attention.layer_groups import LayerAttention
from zllm.executor.attention.metadata import stack_tables
from zllm.executor.host_to_device import consecutive, take_rows, to_device
from zllm.executor.kv.state_step import StateStep, saves_by_sequence
from zllm.executor.requests.state import RequestState
from zllm.protocol import SchedulerOutput

if TYPE_CHECKING:
    from zllm.executor.host.layout import RankLayout
    from zllm.executor.host.model_host import ModelHost
    from zllm.executor.models.vision.features import StepImages


@dataclass(slots=True)
class PendingTokens:
    """Tokens sampled by a launched step that the host does not have yet: the next step's
    inputs take them from the device."""

    rows: Mapping[str, int]  # req_id -> its row of token_ids
    token_ids: torch.Tensor  # int64 [B], on the device

    def fill(self, input_ids: torch.Tensor, slots: list[tuple[int, str]]) -> None:
        """Write each (flat index, req_id)'s pending token into `input_ids`, on the device."""
        if not slots:
            return
        # The usual decode step (every row's token pending, rows in the launched step's
        # order): both sides are slices, one device-to-device copy and no index upload.
        tokens = take_rows(self.token_ids, [self.rows[req_id] for _, req_id in slots])
        dst = [index for index, _ in slots]
        if consecutive(dst):
            input_ids[dst[0] : dst[0] + len(dst)].copy_(tokens)
        else:
            input_ids[to_device(dst, input_ids.device, torch.int64)] = tokens


@dataclass(slots=True)
class StepInputs:
    """One step's flat batch: the scheduled requests in order, their new tokens back to back."""

    states: list[RequestState]
    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # context per request after this step (computed + new)
    token_ends: np.ndarray  # int64 [S]: where each request's rows end in the flat batch
    input_ids: torch.Tensor  # int64 [T]
    # int64 [T], the positions the rotary embedding reads (rope_positions); [3, T] for an
    # M-RoPE model's step with image tokens.
    positions: torch.Tensor
    attn_metadata: StepAttentionMetadata | list[StepAttentionMetadata]  # one, or one per layer
    # A vision model's step computing image tokens: their rows and the encoder's features.
    images: StepImages | None = None


def prepare_inputs(
    host: ModelHost,
    requests: Mapping[str, RequestState],
    so: SchedulerOutput,
    scheduled_tokens: dict[str, int],
    pending: PendingTokens | None = None,
) -> StepInputs:
    """The flat batch of the scheduled tokens, with slots and attention metadata. Requests
    without a state (they failed to start) are left out. `pending`: the tokens a launched,
    unfinished step sampled (launched_step.py); a request's token not yet on the host is
    copied from there on the device."""
    states: list[RequestState] = []
    query_lens: list[int] = []
    input_ids: list[int] = []
    pending_slots: list[tuple[int, str]] = []  # (flat index, req_id): filled on the device
    scheduled = list(scheduled_tokens.items())
    layout, lora = host.layout, host.weights.lora
    if lora is not None:
        # Each adapter's rows side by side (a stable sort: the base first, then by id),
        # so a layer adds an adapter's update to one slice of the batch.
        scheduled.sort(key=lambda item: _lora_id(requests.get(item[0])))
    for req_id, num in scheduled:
        st = requests.get(req_id)
        if st is None:
            continue
        start = st.num_computed_tokens
        drafts = so.spec_token_ids.get(req_id)
        if drafts:  # the last known token, then the proposals it verifies
            input_ids.extend(st.all_token_ids[start : start + num - len(drafts)])
            input_ids.extend(drafts)
        else:
            if start + num > len(st.all_token_ids):  # its last token is still on the device
                pending_slots.append((len(input_ids) + num - 1, req_id))
            input_ids.extend(_known_tokens(st, start, num, pending))
        states.append(st)
        query_lens.append(num)
    seq_lens = [st.num_computed_tokens + q for st, q in zip(states, query_lens, strict=True)]
    positions = token_positions(query_lens, seq_lens)
    attn_metadata = build_attention_metadata(
        layout, states, query_lens, seq_lens, positions, so.state_saves
    )
    if lora is not None:
        lora.set_batch([st.lora_int_id for st in states], query_lens)
    ids = to_device(input_ids, layout.device, torch.int64)
    if pending_slots:
        assert pending is not None
        pending.fill(ids, pending_slots)
    return StepInputs(
        states=states,
        query_lens=query_lens,
        seq_lens=seq_lens,
        token_ends=np.cumsum(query_lens),
        input_ids=ids,
        positions=to_device(
            rope_positions(host, states, query_lens, seq_lens, positions), layout.device
        ),
        attn_metadata=attn_metadata,
        images=None if host.images is None else host.images.for_step(states, query_lens, seq_lens),
    )


def rope_positions(
    host: ModelHost,
    states: list[RequestState],
    query_lens: list[int],
    seq_lens: list[int],
    positions: np.ndarray,
) -> np.ndarray:
    """The positions the model's rotary embedding reads: the tokens' own, except an M-RoPE
    model's (models/vision/mrope.py: shifted by the images before them, three per image token)."""
    if host.mrope is None:
        return positions
    return host.mrope.for_step(states, query_lens, seq_lens, positions)


def token_positions(query_lens: Sequence[int], seq_lens: Sequence[int]) -> np.ndarray:
    """int64 [T]: each new token's position, row by row (a row's tokens end its sequence)."""
    q = np.asarray(query_lens, dtype=np.int64)
    first = np.asarray(seq_lens, dtype=np.int64) - q  # each row's first new position
    return np.arange(int(q.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(q) - q), q)


def _known_tokens(
    st: RequestState, start: int, num: int, pending: PendingTokens | None
) -> list[int]:
    """A request's tokens [start, start + num); a last one that `pending` sampled and the
    host has not yet (st.num_pending) as a 0, which PendingTokens.fill overwrites."""
    known = st.all_token_ids[start : start + num]
    if len(known) == num:
        return known
    assert pending is not None and st.req_id in pending.rows and len(known) + 1 == num, (
        "a missing token must be the pending step's",
        st.req_id,
        start,
        num,
    )
    return [*known, 0]


def _lora_id(st: RequestState | None) -> int:
    return 0 if st is None or st.lora_int_id is None else st.lora_int_id


def build_attention_metadata(
    layout: RankLayout,
    states: list[RequestState],
    query_lens: list[int],
    seq_lens: list[int],
    positions: np.ndarray,
    state_saves: Sequence[tuple[str, int, int]] = (),
) -> StepAttentionMetadata | list[StepAttentionMetadata]:
    """One metadata per (KV cache group, window) the layers use, and a hybrid's state
    layers' StateStep; a list with one entry per layer, or a single metadata when every
    layer shares one (the common case). `positions`:
    the new tokens', row after row (token_positions); `state_saves`: a hybrid's (req_id,
    position, snapshot) saves this step makes (SchedulerOutput.state_saves)."""
    bs = layout.block_size
    built: dict[LayerAttention, StepAttentionMetadata] = {}
    row_of_token = np.repeat(np.arange(len(states)), query_lens)
    for key in dict.fromkeys(layout.layer_attention):
        if key.is_state:  # a hybrid's state layers: their slots (executor/kv/state_step.py)
            slots = [st.state_slot for st in states]
            req_ids = [st.req_id for st in states]
            saves = saves_by_sequence(req_ids, query_lens, seq_lens, state_saves)
            built[key] = StateStep.build(query_lens, seq_lens, slots, layout.device, saves)
            continue
        tables = [st.block_ids[key.group] for st in states]
        slots = stack_tables(tables)[row_of_token, positions // bs] * bs + positions % bs
        extra: dict = {"all_as_decode": True} if layout.config.deterministic else {}
        if key.attention_chunk:  # (the CPU and torch backends' metadata: host/layout.py)
            extra["attention_chunk"] = key.attention_chunk
        if layout.whole_images and any(st.images for st in states):
            # (image tokens that see their whole image: Gemma 3's)
            extra["image_spans"] = [[(i.offset, i.end) for i in st.images] for st in states]
        built[key] = layout.attention.build_metadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            block_size=bs,
            device=layout.device,
            sliding_window=key.sliding_window,
            **extra,
        )
    if len(built) == 1:
        return next(iter(built.values()))
    return [built[key] for key in layout.layer_attention]
