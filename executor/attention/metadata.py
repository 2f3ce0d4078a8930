"""A step's attention metadata for the torch / CPU-kernel path: which rows decode, which
prefill, and the slots each reads and writes (attention.py's module docstring draws the
layout). `StepLayout.check` and the prefill chunks are shared with the GPU path
(attention_cuda.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zllm.executor.host_to_device import to_device

# The longest run of new tokens after cached context that attends as decode rows (one per
# token) rather than as a prefill chunk: a verify step of up to 16 proposals plus its token.
MAX_QUERY_AS_DECODE = 17


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with more than one new token: a fresh prompt or a chunk of a longer one."""

    token_start: int  # its new tokens are [token_start, token_end) of the flat batch
    token_end: int
    context_len: int
    # Cache slots of the whole context [context_len] and the [query_len, context_len] mask,
    # or None for both when the chunk is the whole context (plain causal over the new K/V).
    context_slots: torch.Tensor | None
    attn_mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeBatch:
    """All sequences with exactly one new token, gathered and masked as one padded batch.

    K and V are each gathered by whole blocks with one index_select over the cache viewed as
    [num_blocks, block_size * num_kv_heads * head_dim] (index_select on the leading dim of a
    2-D view is a plain row copy, ~20x faster than advanced indexing into the 5-D cache).
    Padding (positions >= seq_len, and block 0 standing in for missing table entries) is
    masked out, but still enters P @ V as 0 * value, so the cache must hold finite values:
    allocate it with zeros, not empty.
    """

    # int64 [S_dec], where each decode row's token sits in the flat batch (a sequence with a
    # few new tokens after cached context fills one row per token)
    token_indices: torch.Tensor
    block_ids: torch.Tensor  # int64 [S_dec * max_blocks], tables trimmed to the longest context
    max_blocks: int
    seq_lens: torch.Tensor  # int64 [S_dec], context lengths (this token included)
    attn_mask: torch.Tensor  # bool [S_dec, 1, 1, max_blocks * block_size], True where attended
    is_whole_batch: bool  # every token of the step is a decode token, in order
    # Batch-invariant mode: without the kernel, each row attends over exactly its own
    # context (no padding to the batch's longest, which changes SDPA's summation).
    exact: bool = False
    # Gather destination [2, S_dec * max_blocks, block elems], made by the first layer and
    # reused by the rest: a fresh multi-MB tensor per layer costs more in page faults than
    # the copy itself on CPU.
    workspace: torch.Tensor | None = None


@dataclass(slots=True)
class StepLayout:
    """A step's per-sequence arrays, checked once: what every backend's metadata starts from."""

    query_lens: np.ndarray  # int64 [S], new tokens per sequence (>= 1)
    seq_lens: np.ndarray  # int64 [S], context after this step (>= query_len)
    table_lens: np.ndarray  # int64 [S], blocks in each block table (enough for the context)
    query_start_loc: np.ndarray  # int64 [S+1], cumulative query_lens (0, q0, q0+q1, ...)
    slot_mapping: np.ndarray  # int64 [T], one cache slot per new token

    @classmethod
    def check(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | np.ndarray,
        block_size: int,
    ) -> StepLayout:
        """Raise ValueError unless the lists describe one consistent step."""
        num_seqs = len(query_lens)
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, "
                f"got {num_seqs}, {len(seq_lens)}, {len(block_tables)}"
            )
        q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
        ctx_lens = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs)
        if (q_lens < 1).any() or (q_lens > ctx_lens).any():
            raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens} and {seq_lens}")
        table_lens = np.fromiter(map(len, block_tables), np.int64, num_seqs)
        if (table_lens * block_size < ctx_lens).any():
            raise ValueError("a block table holds fewer slots than its sequence's context")
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
        if slots.shape[0] != query_start[-1]:
            raise ValueError(
                f"slot_mapping has {slots.shape[0]} slots for {query_start[-1]} tokens"
            )
        return cls(q_lens, ctx_lens, table_lens, query_start, slots)


def context_slots(table: list[int] | np.ndarray, context_len: int, block_size: int) -> np.ndarray:
    """Cache slots of positions 0..context_len - 1 through one block table: int64 [context_len]."""
    blocks = np.asarray(table[: -(-context_len // block_size)], dtype=np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[:context_len]


def first_visible_key(context_len: int, query_len: int, window: int | None) -> int:
    """The earliest position a chunk's first query sees: 0, or with a sliding window its
    last `window` positions' first (q - window < k, as Hugging Face's band)."""
    if not window:
        return 0
    return max(0, context_len - query_len - window + 1)


def first_visible(query_pos: np.ndarray, window: int | None, chunk: int | None) -> np.ndarray:
    """The first key position each query position sees: 0; with a sliding window its last
    `window` positions' first; with chunked attention (Llama 4's) its chunk's first, the last
    multiple of `chunk` at or before it."""
    if chunk:
        return query_pos // chunk * chunk
    if window:
        return np.maximum(query_pos - window + 1, 0)
    return np.zeros_like(query_pos)


def stack_tables(tables: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
    """The block tables as one int64 [S, longest] array padded with 0, in a few vectorised
    calls: a loop over the rows costs microseconds each, and a step has hundreds of rows."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    stacked = np.zeros((len(tables), max(1, int(lens.max(initial=0)))), np.int64)
    filled = np.arange(stacked.shape[1]) < lens[:, None]
    stacked[filled] = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(lens.sum()))
    return stacked


def padded_tables(
    tables: Sequence[Sequence[int] | np.ndarray], context_lens: np.ndarray, block_size: int
) -> np.ndarray:
    """int32 [S, max blocks]: each row's blocks covering its context, padded with 0."""
    counts = -(-np.asarray(context_lens, dtype=np.int64).reshape(-1) // block_size)
    width = max(1, int(counts.max(initial=1)))
    stacked = stack_tables(tables)[:, :width]
    if stacked.shape[1] < width:  # (a table shorter than its context: the caller's check)
        stacked = np.pad(stacked, ((0, 0), (0, width - stacked.shape[1])))
    return np.where(np.arange(width) < counts[:, None], stacked, 0).astype(np.int32)


def build_prefill_chunks(
    layout: StepLayout,
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    chunk_mask: Callable[[int, int], torch.Tensor],
    sliding_window: int | None = None,
    seq_ids: np.ndarray | None = None,
    attention_chunk: int | None = None,
) -> list[PrefillChunk]:
    """The sequences with more than one new token; `chunk_mask(query_len, context_len)` makes
    the attention mask of a chunk that follows cached context (each backend its own kind).

    With a `sliding_window`, a chunk reads only the keys its earliest query can see and every
    mask is an explicit band (`first_visible`); blocks before that are never touched, so the
    block manager may have released them. With an `attention_chunk`, likewise: each query sees
    the keys of its own chunk of that many positions.
    """
    limit = attention_chunk or sliding_window
    chunks = []
    if seq_ids is None:
        seq_ids = np.flatnonzero(layout.query_lens > 1)
    for i in seq_ids.tolist():
        start = int(layout.query_start_loc[i])
        q_len, ctx_len = int(layout.query_lens[i]), int(layout.seq_lens[i])
        if limit is not None and ctx_len > limit:
            chunks.append(
                _limited_chunk(
                    start, q_len, ctx_len, block_tables[i], block_size, device,
                    sliding_window, attention_chunk,
                )
            )  # fmt: skip
            continue
        if q_len == ctx_len:
            chunks.append(PrefillChunk(start, start + q_len, ctx_len, None, None))
            continue
        slots = to_device(context_slots(block_tables[i], ctx_len, block_size), device)
        mask = chunk_mask(q_len, ctx_len)
        chunks.append(PrefillChunk(start, start + q_len, ctx_len, slots, mask))
    return chunks


def _limited_chunk(
    start: int,
    q_len: int,
    ctx_len: int,
    table: list[int],
    block_size: int,
    device: torch.device | str,
    window: int | None,
    chunk: int | None,
) -> PrefillChunk:
    """A chunk of a sliding-window (or chunked-attention) layer whose context is longer than
    the window (the chunk): its queries read from the first key its earliest query sees."""
    first_query = ctx_len - q_len
    query_pos = np.arange(first_query, ctx_len)
    firsts = first_visible(query_pos, window, chunk)
    first_key = int(firsts[0])

    def visible(key_pos: np.ndarray) -> np.ndarray:
        return (key_pos[None, :] >= firsts[:, None]) & (key_pos[None, :] <= query_pos[:, None])

    if first_query == 0:  # a whole prompt: attend over its new K/V, under a band mask
        mask = visible(query_pos)
        return PrefillChunk(start, start + q_len, ctx_len, None, to_device(mask, device))
    slots = context_slots(table, ctx_len, block_size)[first_key:]
    mask = visible(np.arange(first_key, ctx_len))
    return PrefillChunk(
        start, start + q_len, ctx_len, to_device(slots, device), to_device(mask, device)
    )


@dataclass(slots=True)
class AttentionMetadata:
    """A flat batch of T new tokens from S sequences, grouped by sequence in order, split once
    per step (not once per layer) into one padded decode batch and the prefill chunks."""

    slot_mapping: torch.Tensor  # int64 [T], cache slot for each new token
    block_size: int
    decode: DecodeBatch | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Set for the layers of a sliding-window group: each query sees its last `sliding_window`
    # positions, and the decode batch holds only the blocks inside that window.
    sliding_window: int | None = None
    # Set for chunked-attention layers (Llama 4's): each query sees the positions of its own
    # chunk of that many tokens, and the decode batch holds only its chunk's blocks.
    attention_chunk: int | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | np.ndarray,
        block_size: int,
        device: torch.device | str,
        sliding_window: int | None = None,
        all_as_decode: bool = False,
        image_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
        attention_chunk: int | None = None,
    ) -> AttentionMetadata:
        """`sliding_window`: build for layers whose queries see only their last that many
        positions (block tables may then hold -1 for blocks before the window).
        `all_as_decode` (batch-invariant mode): every query token is a decode row, attending
        exactly its own context, whatever the chunk it arrived in.
        `image_spans`: per sequence, the [start, end) positions of each image's tokens, which
        also attend to the later tokens of their own image (a vision model's image
        attention); a sequence computing any of them is a prefill chunk."""
        layout = StepLayout.check(query_lens, seq_lens, block_tables, slot_mapping, block_size)
        tables = stack_tables(block_tables)

        def chunk_mask(q_len: int, ctx_len: int) -> torch.Tensor:
            query_pos = ctx_len - q_len + np.arange(q_len)
            return to_device(np.arange(ctx_len)[None, :] <= query_pos[:, None], device)

        q_lens = layout.query_lens
        as_decode = (q_lens == 1) | ((q_lens <= MAX_QUERY_AS_DECODE) & (q_lens < layout.seq_lens))
        if all_as_decode:
            as_decode = np.ones_like(as_decode)
        with_images = _computing_images(layout, image_spans)
        as_decode &= ~with_images
        decode = None
        if as_decode.any():
            limits = (sliding_window, attention_chunk)
            decode = _build_decode_batch(
                np.flatnonzero(as_decode), layout, tables, block_size, device, *limits
            )
            decode.is_whole_batch = bool(as_decode.all())
            decode.exact = all_as_decode
        prefills = build_prefill_chunks(
            layout, block_tables, block_size, device, chunk_mask, sliding_window,
            seq_ids=np.flatnonzero(~as_decode), attention_chunk=attention_chunk,
        )  # fmt: skip
        if with_images.any():
            _see_own_images(prefills, layout, with_images, image_spans, device)
        return cls(
            slot_mapping=to_device(layout.slot_mapping, device),
            block_size=block_size,
            decode=decode,
            prefills=prefills,
            sliding_window=sliding_window,
            attention_chunk=attention_chunk,
        )


def _computing_images(
    layout: StepLayout, image_spans: Sequence[Sequence[tuple[int, int]]] | None
) -> np.ndarray:
    """bool [S]: the sequences whose new tokens include image tokens."""
    found = np.zeros(len(layout.query_lens), dtype=bool)
    for i, spans in enumerate(image_spans or ()):
        last = int(layout.seq_lens[i])
        first = last - int(layout.query_lens[i])
        found[i] = any(start < last and end > first for start, end in spans)
    return found


def _see_own_images(
    prefills: list[PrefillChunk],
    layout: StepLayout,
    with_images: np.ndarray,
    image_spans: Sequence[Sequence[tuple[int, int]]] | None,
    device: torch.device | str,
) -> None:
    """_see_own_image for each chunk of a sequence computing image tokens."""
    assert image_spans is not None
    starts = {int(layout.query_start_loc[i]): i for i in np.flatnonzero(with_images)}
    for chunk in prefills:
        i = starts.get(chunk.token_start)
        if i is not None:
            _see_own_image(chunk, image_spans[i], int(layout.seq_lens[i]), device)


def _see_own_image(
    chunk: PrefillChunk,
    spans: Sequence[tuple[int, int]],
    ctx_len: int,
    device: torch.device | str,
) -> None:
    """Let each image token of the chunk see its image's later tokens too (the chunk holds
    them all: core/scheduler.py), on top of the causal (or windowed) mask: a later key of
    the same image is never outside a window, so OR-ing it in is the model's
    AND(window, OR(causal, same image))."""
    q_len = chunk.token_end - chunk.token_start
    query_pos = np.arange(ctx_len - q_len, ctx_len)
    if chunk.attn_mask is None:  # the whole context is new: keys are the queries
        key_pos = query_pos
        mask = key_pos[None, :] <= query_pos[:, None]
    else:
        key_pos = np.arange(ctx_len - chunk.attn_mask.shape[-1], ctx_len)
        mask = chunk.attn_mask.cpu().numpy().reshape(q_len, -1).copy()
    for start, end in spans:
        in_query = (query_pos >= start) & (query_pos < end)
        in_key = (key_pos >= start) & (key_pos < end)
        mask |= in_query[:, None] & in_key[None, :]
    shape = (q_len, len(key_pos)) if chunk.attn_mask is None else tuple(chunk.attn_mask.shape)
    chunk.attn_mask = to_device(mask.reshape(shape), device)


def _build_decode_batch(
    seq_ids: np.ndarray,
    layout: StepLayout,
    tables: np.ndarray,
    block_size: int,
    device: torch.device | str,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
) -> DecodeBatch:
    """Without a window each row gathers blocks 0.. of its table; with one, from the block
    holding the first position its query sees (earlier blocks may be released). A sequence
    with q new tokens fills q rows, row j seeing the context up to its own position."""
    q_lens = layout.query_lens[seq_ids]
    token_indices = layout.query_start_loc[seq_ids]
    lens = layout.seq_lens[seq_ids]
    if (q_lens > 1).any():
        rows_of = np.repeat(np.arange(len(seq_ids)), q_lens)
        offset = np.arange(len(rows_of)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        token_indices = token_indices[rows_of] + offset
        lens = lens[rows_of] - q_lens[rows_of] + offset + 1
        seq_ids = seq_ids[rows_of]
    first_pos = first_visible(lens - 1, sliding_window, attention_chunk)
    first_block = first_pos // block_size
    num_blocks = -(-lens // block_size) - first_block
    max_blocks = int(num_blocks.max())
    cols = first_block[:, None] + np.arange(max_blocks)[None, :]
    in_table = cols < tables.shape[1]
    block_ids = np.where(
        in_table, tables[seq_ids[:, None], np.minimum(cols, tables.shape[1] - 1)], 0
    )
    # Padding and released blocks (-1) read block 0 under the mask: finite, never attended.
    block_ids = np.maximum(block_ids, 0).reshape(-1)
    pos = first_block[:, None] * block_size + np.arange(max_blocks * block_size)[None, :]
    mask = (pos >= first_pos[:, None]) & (pos < lens[:, None])
    return DecodeBatch(
        token_indices=to_device(np.ascontiguousarray(token_indices), device),
        block_ids=to_device(np.ascontiguousarray(block_ids), device),
        max_blocks=max_blocks,
        seq_lens=to_device(np.ascontiguousarray(lens), device),
        attn_mask=to_device(mask[:, None, None, :], device),
        is_whole_batch=False,
    )
