"""Every prefilling sequence of a step in one attention call per layer.

The queries of all prefilling sequences sit packed in the step's flat batch; each reads its
keys from the paged KV cache (this step's K/V are written there first), so a whole prompt, a
chunk after cached context and a prompt after a prefix-cache hit are one case, and a sliding
window is a band. The host describes the batch once per step (`PrefillBatch.build`); every
layer then makes one call, by one of two implementations:

- flash (bf16/fp16 where torch's FlashAttention-2 runs, sm80+): the keys of every sequence
  gathered from the cache by slot into one packed K and one packed V (two index_selects),
  then one varlen FlashAttention call on tensor cores, causal aligned bottom-right (query j
  of a chunk sits at context position ctx_len - q_len + j), window as its left size.
- kernel (csrc/paged_prefill.cu: fp32, older GPUs, or ZLLM_CUDA_PREFILL=kernel): reads the
  keys in place through the block tables, fp32 FMAs on CUDA cores. Its batch description:

    seqs   [P, 3]   first token in the flat batch, query count, context length
    tiles  [N, 2]   sequence, first query: one thread block per tile of TILE_ROWS queries
                    and query head (grid = (N, num_heads))

Both replaced one SDPA call per prefilling sequence per layer (480 Python calls for a step of
16 prompts on SmolLM2's 30 layers); ZLLM_CUDA_PREFILL=sdpa still runs that, for A/B figures.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from zllm.executor import cuda_kernels as ck
from zllm.executor.cuda_kernels import (
    _DTYPE_TAG,
    NUM_THREADS,
    SUPPORTED_HEAD_DIMS,
    CudaKernelError,
    KernelLaunch,
    _check_cache,
    _check_devices,
    _ptr,
)

logger = logging.getLogger(__name__)

TILE_ROWS = 16  # query tokens per thread block: kRows of csrc/paged_prefill.cu
PREFILL_MODES = ("auto", "kernel", "sdpa")
FLASH_DTYPES = (torch.bfloat16, torch.float16)


def prefill_mode() -> str:
    """ZLLM_CUDA_PREFILL: auto (flash where it runs, else the kernel), kernel, or sdpa (one
    call per sequence, as before the varlen path; for A/B measurements)."""
    mode = os.environ.get("ZLLM_CUDA_PREFILL", "auto")
    if mode not in PREFILL_MODES:
        raise ValueError(f"ZLLM_CUDA_PREFILL={mode!r}: expected one of {PREFILL_MODES}")
    return mode


@dataclass(frozen=True, slots=True)
class FlashInputs:
    """The prefill batch packed for one varlen FlashAttention call."""

    query_rows: torch.Tensor  # int64 [Tq]: the prefill queries' rows of the flat batch
    key_slots: torch.Tensor  # int64 [Tk]: cache slots of every sequence's visible keys
    cu_queries: torch.Tensor  # int32 [P + 1]: cumulative query counts
    cu_keys: torch.Tensor  # int32 [P + 1]: cumulative key counts
    max_queries: int
    max_keys: int

    @classmethod
    def build(
        cls,
        first_tokens: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        tables: list[np.ndarray | list[int]],
        block_size: int,
        device: torch.device | str,
        window: int,
    ) -> FlashInputs:
        """Keys from each sequence's first visible position: 0, or with a window the first
        one its earliest query sees (so released blocks before it are never read)."""
        rows, slots = [], []
        key_lens = np.empty(len(query_lens), dtype=np.int64)
        for i, table in enumerate(tables):
            q_len, ctx_len = int(query_lens[i]), int(context_lens[i])
            first_key = max(0, ctx_len - q_len - window + 1) if window else 0
            positions = np.arange(first_key, ctx_len, dtype=np.int64)
            blocks = np.asarray(table[: -(-ctx_len // block_size)], dtype=np.int64)
            slots.append(blocks[positions // block_size] * block_size + positions % block_size)
            rows.append(np.arange(first_tokens[i], first_tokens[i] + q_len, dtype=np.int64))
            key_lens[i] = ctx_len - first_key
        q_lens = np.asarray(query_lens, dtype=np.int64)

        def cumulative(lens: np.ndarray) -> torch.Tensor:
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            return torch.from_numpy(cu).to(device, non_blocking=True)

        return cls(
            query_rows=torch.from_numpy(np.concatenate(rows)).to(device, non_blocking=True),
            key_slots=torch.from_numpy(np.concatenate(slots)).to(device, non_blocking=True),
            cu_queries=cumulative(q_lens),
            cu_keys=cumulative(key_lens),
            max_queries=int(q_lens.max()),
            max_keys=int(key_lens.max()),
        )


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """The prefilling sequences of one step, on the device, for every layer's launch."""

    rows: torch.Tensor  # int32, the seqs table [P, 3] then the tiles table [N, 2], flat
    block_tables: torch.Tensor  # int32 [P, max_blocks]
    num_seqs: int
    num_tiles: int
    window: int  # sliding window (0: none)
    flash: FlashInputs  # the same batch packed for FlashAttention

    @property
    def seqs(self) -> torch.Tensor:
        return self.rows[: 3 * self.num_seqs]

    @property
    def tiles(self) -> torch.Tensor:
        return self.rows[3 * self.num_seqs :]

    @classmethod
    def build(
        cls,
        first_tokens: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: list[np.ndarray | list[int]],
        block_size: int,
        device: torch.device | str,
        window: int | None = None,
    ) -> PrefillBatch:
        """One row per prefilling sequence: where its queries start in the flat batch, how
        many, and its context length (this step's tokens included). Table entries before a
        window's first block are never read (they may be -1)."""
        num_seqs = len(query_lens)
        seqs = np.stack([first_tokens, query_lens, context_lens], axis=1).astype(np.int32)
        tiles_per_seq = -(-np.asarray(query_lens, dtype=np.int64) // TILE_ROWS)
        tile_seq = np.repeat(np.arange(num_seqs, dtype=np.int32), tiles_per_seq)
        tile_starts = np.cumsum(tiles_per_seq) - tiles_per_seq
        first_query = (np.arange(len(tile_seq)) - np.repeat(tile_starts, tiles_per_seq)) * TILE_ROWS
        tiles = np.stack([tile_seq, first_query.astype(np.int32)], axis=1)
        width = max(1, max((-(-int(n) // block_size) for n in context_lens), default=1))
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, table in enumerate(block_tables):
            n = -(-int(context_lens[i]) // block_size)
            tables[i, :n] = np.asarray(table[:n], dtype=np.int32)
        rows = np.concatenate([seqs.ravel(), tiles.ravel()])
        window = int(window or 0)
        return cls(
            rows=torch.from_numpy(rows).to(device, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
            num_seqs=num_seqs,
            num_tiles=len(tiles),
            window=window,
            flash=FlashInputs.build(
                first_tokens, query_lens, context_lens, block_tables, block_size, device, window
            ),
        )


def plan_paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    """The launch of zllm_paged_prefill: q and out [T, heads, D] over the step's flat batch
    (only the prefill tokens' rows of `out` are written)."""
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(kv_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.dtype != kv_cache.dtype or q.stride(2) != 1:
        raise CudaKernelError(
            f"q must be {kv_cache.dtype} [tokens, heads, {head_dim}] with a contiguous last dim, "
            f"got {q.dtype} {list(q.shape)} strides {q.stride()}"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise CudaKernelError(f"head_dim={head_dim} unsupported (supported: {SUPPORTED_HEAD_DIMS})")
    num_heads = q.shape[1]
    if num_heads % num_kv_heads != 0:
        raise CudaKernelError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or not out.is_contiguous():
        raise CudaKernelError("out must be a contiguous tensor shaped and typed like q")
    _check_devices(kv_cache, q=q, out=out, rows=batch.rows, block_tables=batch.block_tables)
    if batch.num_tiles == 0:
        return []
    if num_heads > 65535:
        raise CudaKernelError(f"{num_heads} heads exceed one launch's grid (65535)")
    seqs, tiles = batch.seqs, batch.tiles
    return [
        KernelLaunch(
            "paged_prefill.cu",
            f"zllm_paged_prefill<{_DTYPE_TAG[q.dtype]}, {head_dim}>",
            (batch.num_tiles, num_heads, 1),
            (NUM_THREADS, 1, 1),
            (
                _ptr(out),
                _ptr(q),
                np.int64(q.stride(0)),
                np.int64(q.stride(1)),
                _ptr(kv_cache),
                np.int64(num_blocks * block_size),
                _ptr(batch.block_tables),
                np.int32(0),  # the tables are int32
                np.int64(batch.block_tables.stride(0)),
                _ptr(seqs),
                _ptr(tiles),
                np.int32(num_heads),
                np.int32(num_kv_heads),
                np.int32(block_size),
                np.float32(scale),
                np.int32(batch.window),
            ),
            (q, out, seqs, tiles, batch.block_tables),
        )
    ]


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor,
    impl: str | None = None,
) -> torch.Tensor:
    """Writes the prefill tokens' attention into their rows of `out` ([T, heads, D]).
    `impl`: "flash" or "kernel"; None picks flash where it runs (`uses_flash`)."""
    if impl is None:
        impl = "flash" if uses_flash(q) else "kernel"
    if impl == "flash":
        flash_prefill(q, kv_cache, batch.flash, scale, out, batch.window)
    else:
        ck.run_launches(plan_paged_prefill(q, kv_cache, batch, scale, out), q.device)
    return out


def uses_flash(q: torch.Tensor) -> bool:
    """FlashAttention for this layer's prefill: bf16/fp16 on a GPU where it runs, a head
    size it has (a multiple of 8 up to 256), and not ZLLM_CUDA_PREFILL=kernel."""
    head_dim = q.shape[-1]
    return (
        q.dtype in FLASH_DTYPES
        and q.is_cuda
        and head_dim % 8 == 0
        and head_dim <= 256
        and prefill_mode() == "auto"
        and flash_available(q.device.index or 0)
    )


@functools.cache
def flash_available(device_index: int) -> bool:
    """torch's FlashAttention-2 runs here (sm80+, built in), checked once per device with a
    tiny varlen call; else the kernel serves every prefill, with one warning."""
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 8 or not torch.backends.cuda.is_flash_attention_available():
        logger.warning("FlashAttention unavailable on this GPU: prefill by csrc/paged_prefill.cu")
        return False
    try:
        x = torch.zeros(2, 2, 64, dtype=torch.bfloat16, device=f"cuda:{device_index}")
        cu = torch.tensor([0, 2], dtype=torch.int32, device=x.device)
        torch.ops.aten._flash_attention_forward(
            x, x[:, :1], x[:, :1], cu, cu, 2, 2, 0.0, True, False
        )
    except (RuntimeError, TypeError) as exc:
        logger.warning("FlashAttention varlen failed (%s): prefill by csrc/paged_prefill.cu", exc)
        return False
    return True


def flash_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    flash: FlashInputs,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """One varlen FlashAttention call over every prefilling sequence: K/V gathered by slot,
    causal aligned to each sequence's last key, a window as the left band (W - 1)."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
    key = slots[0].index_select(0, flash.key_slots)
    value = slots[1].index_select(0, flash.key_slots)
    attended = torch.ops.aten._flash_attention_forward(
        q.index_select(0, flash.query_rows),
        key,
        value,
        flash.cu_queries,
        flash.cu_keys,
        flash.max_queries,
        flash.max_keys,
        0.0,  # dropout
        True,  # causal, bottom-right aligned when a sequence has more keys than queries
        False,
        scale=scale,
        window_size_left=window - 1 if window else None,
        window_size_right=0 if window else None,
    )[0]
    out.index_copy_(0, flash.query_rows, attended)
