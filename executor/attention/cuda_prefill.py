"""Every prefilling sequence of a step in one attention call per layer.

The queries of all prefilling sequences sit packed in the step's flat batch; each reads its
keys from the paged KV cache (this step's K/V are written there first), so a whole prompt, a
chunk after cached context and a prompt after a prefix-cache hit are one case, and a sliding
window is a band. The host describes the batch once per step (`PrefillBatch.build`; the
first layer's call makes its implementation's device form, the others reuse it); every
layer then makes one call, by one of two implementations:

- flash (bf16/fp16 where torch's FlashAttention-2 runs, sm80+): the keys of every sequence
  gathered from the cache by slot into one packed K and one packed V, the queries out of the
  flat batch (three index_selects; the output goes back with one index_copy), then one
  varlen FlashAttention call on tensor cores, causal aligned bottom-right (query j
  of a chunk sits at context position ctx_len - q_len + j), window as its left size.
- kernel (csrc/paged_prefill.cu: fp32, older GPUs, layers with attention sinks (gpt-oss),
  which the varlen FlashAttention call cannot take, or ZLLM_CUDA_PREFILL=kernel): reads the
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
from dataclasses import dataclass, field

import numpy as np
import torch

from zllm.executor.attention.metadata import context_slots, first_visible_key, padded_tables
from zllm.executor.host_to_device import to_device
from zllm.executor.kernels import cuda as ck
from zllm.executor.kernels.cuda import (
    _DTYPE_TAG,
    CudaKernelError,
    KernelLaunch,
    _check_devices,
    _ptr,
    check_query,
    check_sinks,
)

logger = logging.getLogger(__name__)

TILE_ROWS = 16  # query tokens per thread block: kRows of csrc/paged_prefill.cu
PREFILL_THREADS = 128  # kPrefillThreads of csrc/paged_prefill.cu (its row mapping needs it)
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
class KernelInputs:
    """The prefill batch as csrc/paged_prefill.cu reads it."""

    rows: torch.Tensor  # int32, the seqs table [P, 3] then the tiles table [N, 2], flat
    block_tables: torch.Tensor  # int32 [P, max_blocks]
    num_seqs: int
    num_tiles: int

    @property
    def seqs(self) -> torch.Tensor:
        return self.rows[: 3 * self.num_seqs]

    @property
    def tiles(self) -> torch.Tensor:
        return self.rows[3 * self.num_seqs :]


@dataclass(frozen=True, slots=True)
class FlashInputs:
    """The prefill batch packed for one varlen FlashAttention call."""

    query_rows: torch.Tensor  # int64 [Tq]: the prefill queries' rows of the flat batch
    key_slots: torch.Tensor  # int64 [Tk]: cache slots of every sequence's visible keys
    cu_queries: torch.Tensor  # int32 [P + 1]: cumulative query counts
    cu_keys: torch.Tensor  # int32 [P + 1]: cumulative key counts
    max_queries: int
    max_keys: int


@dataclass(slots=True)
class PrefillBatch:
    """The prefilling sequences of one step: per sequence, where its queries start in the
    flat batch, how many, its context length (this step's tokens included) and block table.
    Each layer's call reads the device form its implementation needs, made on first use
    and kept for the step's other layers (`kernel` or `flash`), so a step builds one."""

    first_tokens: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: list[np.ndarray | list[int]]  # entries before a window may be -1
    block_size: int
    device: torch.device | str
    window: int = 0  # sliding window (0: none)
    mode: str = "auto"  # ZLLM_CUDA_PREFILL when the step was built
    _kernel: KernelInputs | None = field(default=None, repr=False)
    _flash: FlashInputs | None = field(default=None, repr=False)

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
        mode: str | None = None,
    ) -> PrefillBatch:
        """`mode`: ZLLM_CUDA_PREFILL as the caller read it (None: read it here)."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        if not len(query_lens) or (query_lens < 1).any() or (query_lens > context_lens).any():
            raise ValueError("a prefill batch needs sequences of 1..context_len new tokens")
        return cls(
            np.asarray(first_tokens, dtype=np.int64),
            query_lens,
            context_lens,
            list(block_tables),
            block_size,
            device,
            int(window or 0),
            mode or prefill_mode(),
        )

    @property
    def kernel(self) -> KernelInputs:
        if self._kernel is None:
            num_seqs = len(self.query_lens)
            seqs = np.stack([self.first_tokens, self.query_lens, self.context_lens], axis=1)
            tiles_per_seq = -(-self.query_lens // TILE_ROWS)
            tile_seq = np.repeat(np.arange(num_seqs), tiles_per_seq)
            tile_starts = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
            first_query = (np.arange(len(tile_seq)) - tile_starts) * TILE_ROWS
            tiles = np.stack([tile_seq, first_query], axis=1)
            rows = np.concatenate([seqs.ravel(), tiles.ravel()]).astype(np.int32)
            tables = padded_tables(self.block_tables, self.context_lens, self.block_size)
            self._kernel = KernelInputs(
                to_device(rows, self.device),
                to_device(tables, self.device),
                num_seqs,
                len(tiles),
            )
        return self._kernel

    @property
    def flash(self) -> FlashInputs:
        """Keys from each sequence's first visible position (0, or with a window the first
        its earliest query sees: released blocks before it are never read)."""
        if self._flash is None:
            rows, slots, key_lens = [], [], []
            for first, q_len, ctx_len, table in zip(
                self.first_tokens.tolist(),
                self.query_lens.tolist(),
                self.context_lens.tolist(),
                self.block_tables,
                strict=True,
            ):
                first_key = first_visible_key(ctx_len, q_len, self.window)
                slots.append(context_slots(table, ctx_len, self.block_size)[first_key:])
                rows.append(np.arange(first, first + q_len, dtype=np.int64))
                key_lens.append(ctx_len - first_key)

            def cumulative(lens) -> torch.Tensor:
                return to_device(
                    np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), self.device
                )

            self._flash = FlashInputs(
                query_rows=to_device(np.concatenate(rows), self.device),
                key_slots=to_device(np.concatenate(slots), self.device),
                cu_queries=cumulative(self.query_lens),
                cu_keys=cumulative(key_lens),
                max_queries=int(self.query_lens.max()),
                max_keys=max(key_lens),
            )
        return self._flash


def plan_paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> list[KernelLaunch]:
    """The launch of zllm_paged_prefill: q and out [T, heads, D] over the step's flat batch
    (only the prefill tokens' rows of `out` are written); `sinks` fp32 [heads] or None."""
    num_blocks, block_size, num_kv_heads, head_dim = check_query(q, kv_cache, out)
    check_sinks(sinks, q)
    if q.stride(2) != 1:
        raise CudaKernelError(f"q's last dim must be contiguous, got strides {q.stride()}")
    num_heads = q.shape[1]
    if num_heads % num_kv_heads != 0:
        raise CudaKernelError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    inputs = batch.kernel
    _check_devices(kv_cache, q=q, out=out, rows=inputs.rows, block_tables=inputs.block_tables)
    if num_heads > 65535:
        raise CudaKernelError(f"{num_heads} heads exceed one launch's grid (65535)")
    seqs, tiles = inputs.seqs, inputs.tiles
    return [
        KernelLaunch(
            "paged_prefill.cu",
            f"zllm_paged_prefill<{_DTYPE_TAG[q.dtype]}, {head_dim}>",
            (inputs.num_tiles, num_heads, 1),
            (PREFILL_THREADS, 1, 1),
            (
                _ptr(out),
                _ptr(q),
                np.int64(q.stride(0)),
                np.int64(q.stride(1)),
                _ptr(kv_cache),
                np.int64(num_blocks * block_size),
                _ptr(inputs.block_tables),
                np.int32(0),  # the tables are int32
                np.int64(inputs.block_tables.stride(0)),
                _ptr(seqs),
                _ptr(tiles),
                np.int32(num_heads),
                np.int32(num_kv_heads),
                np.int32(block_size),
                np.float32(scale),
                np.int32(batch.window),
                _ptr(sinks),
            ),
            tuple(t for t in (q, out, seqs, tiles, inputs.block_tables, sinks) if t is not None),
        )
    ]


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor,
    impl: str | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes the prefill tokens' attention into their rows of `out` ([T, heads, D]).
    `impl`: "flash" or "kernel"; None picks flash where it runs (`uses_flash`). A layer with
    attention `sinks` (fp32 [heads]) always takes the kernel: FlashAttention's varlen call has
    no sink logit."""
    if impl is None:
        impl = "flash" if sinks is None and uses_flash(q, batch.mode) else "kernel"
    if impl == "flash":
        if sinks is not None:
            raise ValueError("the FlashAttention prefill takes no attention sinks")
        flash_prefill(q, kv_cache, batch.flash, scale, out, batch.window)
    elif impl == "kernel":
        ck.run_launches(plan_paged_prefill(q, kv_cache, batch, scale, out, sinks), q.device)
    else:
        raise ValueError(f"prefill implementation {impl!r}: expected 'flash' or 'kernel'")
    return out


def uses_flash(q: torch.Tensor, mode: str = "auto") -> bool:
    """FlashAttention for this layer's prefill: bf16/fp16 on a GPU where it runs, a head
    size it has (a multiple of 8 up to 256), and not ZLLM_CUDA_PREFILL=kernel."""
    head_dim = q.shape[-1]
    return (
        mode == "auto"
        and q.dtype in FLASH_DTYPES
        and q.is_cuda
        and head_dim % 8 == 0
        and head_dim <= 256
        and flash_available(q.device.index or 0)
    )


@functools.cache
def flash_available(device_index: int) -> bool:
    """torch's FlashAttention-2 runs here (sm80+, built in), checked once per device with a
    tiny varlen call shaped as flash_prefill's (GQA, a window, a scale); else the kernel
    serves every prefill, with one warning."""
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 8 or not torch.backends.cuda.is_flash_attention_available():
        logger.warning("FlashAttention unavailable on this GPU: prefill by csrc/paged_prefill.cu")
        return False
    try:
        x = torch.zeros(2, 2, 64, dtype=torch.bfloat16, device=f"cuda:{device_index}")
        cu = torch.tensor([0, 2], dtype=torch.int32, device=x.device)
        torch.ops.aten._flash_attention_forward(
            x, x[:, :1], x[:, :1], cu, cu, 2, 2, 0.0, True, False,
            scale=0.125, window_size_left=1, window_size_right=0,
        )  # fmt: skip
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
