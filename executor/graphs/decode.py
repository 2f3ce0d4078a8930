"""CUDA graphs for decode-only steps: capture once per batch size, then replay.

A decode step launches a few hundred small kernels (per layer: norms, GEMMs, rope, cache
write, attention); at small batch sizes launching them costs more than running them. A
captured graph replays all of them with one launch.

    capture():  for size in [256, 128, ..., 2, 1] (largest first, one shared memory pool):
                    warm up eagerly, then record model(input_ids[:size], positions[:size], ...)
                    with attention metadata built on the static buffers below
    run():      a decode-only batch of n <= 256 tokens: copy its inputs into the static
                buffers, pad to the next captured size, replay, return hidden[:n].
                Anything else returns None and the caller runs the model eagerly.

Static buffers (device, sized for the largest captured batch):

    input_ids    int64 [max_bs]                  padding rows: token 0
    positions    int64 [max_bs]                  position 0
    slot_mapping int64 [max_bs]                  slot -1 (the cache write skips it)
    seq_lens     int32 [max_bs]                  1 (attends to one slot of block 0)
    block_tables int32 [max_bs, max_blocks_per_seq]  block 0

A model whose layers attend in several ways (sliding-window layers, a hybrid cache's second
KV cache group: `layer_attention`) gets slot_mapping, seq_lens and block_tables once per
distinct (group, window), and each layer's captured metadata reads its own set.

The graph's attention reads seq_lens and block_tables from device memory, so one graph serves
every context length up to max_blocks_per_seq * block_size: its split-K grid is sized for
that maximum and the partitions past a sequence's end exit at once. (A small batch's graph
therefore has many short partitions, most of them empty at short contexts; one that exits
at once costs well under a microsecond.)

The returned hidden states live in the graph's output buffer, which the next replay of the
same size overwrites: consume them (logits, sampling) before the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Sequence

import torch

from zllm.executor.attention.cuda import CudaAttentionMetadata
from zllm.executor.attention.layer_groups import LayerAttention
from zllm.executor.kernels.cuda import DecodeWorkspace, plan_decode

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sizes_to_capture(limit: int, sizes: Sequence[int]) -> list[int]:
    """The sizes below `limit` (a step never exceeds it) and the first that holds it, sorted."""
    ordered = sorted(set(sizes))
    holding = [s for s in ordered if s >= limit]
    return [s for s in ordered if s < limit] + holding[:1]


def smallest_holding(sizes: Sequence[int], captured: Container[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` that is at least `n` and was captured, if any."""
    return next((s for s in sizes if s >= n and s in captured), None)


def attention_sets(
    layer_attention: Sequence[LayerAttention] | None, num_layers: int
) -> tuple[list[LayerAttention | None], list[int], list[int]]:
    """The distinct (KV cache group, window) pairs the layers attend with, in first-layer
    order (one, None, when `layer_attention` is not given: `num_layers` layers share it);
    per layer, which of them it uses; per pair, its first layer (whose eager metadata
    fills that pair's static buffers)."""
    per_layer = list(layer_attention) if layer_attention else [None] * num_layers
    keys = list(dict.fromkeys(per_layer))
    return keys, [keys.index(k) for k in per_layer], [per_layer.index(k) for k in keys]


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        *,
        num_heads: int,
        head_dim: int,
        capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES,
        enabled: bool = True,
        device: torch.device | str | None = None,
        layer_attention: list[LayerAttention] | None = None,
    ) -> None:
        """`enabled=False` (--enforce-eager) makes run() always answer None.
        `layer_attention`: per layer, the block tables and window its attention uses (None:
        every layer shares one metadata without a window)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_blocks_per_seq * block_size
        self.device = torch.device(device) if device is not None else kv_caches[0].device
        self.enabled = enabled and self.device.type == "cuda"
        # A batch never exceeds max_num_seqs.
        self.capture_sizes = sizes_to_capture(max_num_seqs, capture_sizes)
        self.max_batch = self.capture_sizes[-1] if self.capture_sizes else 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        # One set of attention buffers per distinct (group, window), in first-layer order;
        # per layer, which set its metadata reads; per set, a layer whose eager metadata
        # fills it.
        keys, self._set_of_layer, self._first_layer_of_set = attention_sets(layer_attention, 1)
        self.attention_keys = keys
        self.buffers = [_AttentionBuffers(n, max_blocks_per_seq, dev) for _ in keys]
        # Split-K scratch for the captured size that needs most (each size has its own
        # partition length: cuda_kernels.plan_decode), made now so that no replay allocates
        # and every graph keeps pointing at the same buffer.
        self.workspace = DecodeWorkspace()
        num_kv_heads = kv_caches[0].shape[3]
        need = 0
        for size in self.capture_sizes:
            parts = plan_decode(num_heads, num_kv_heads, self.max_seq_len, size).max_partitions
            if parts > 1:
                need = max(need, DecodeWorkspace.num_floats(size, num_heads, parts, head_dim))
        if need:
            self.workspace.reserve(need, dev)

    def _metadata(self, size: int) -> CudaAttentionMetadata | list[CudaAttentionMetadata]:
        """The captured step's metadata, shaped as the eager step's: one, or one per layer."""
        metas = [
            CudaAttentionMetadata.for_decode(
                slot_mapping=b.slot_mapping[:size],
                block_tables=b.block_tables[:size],
                seq_lens=b.seq_lens[:size],
                block_size=self.block_size,
                max_seq_len=self.max_seq_len,
                workspace=self.workspace,
                window=int(key.sliding_window or 0) if key is not None else 0,
            )
            for key, b in zip(self.attention_keys, self.buffers, strict=True)
        ]
        if len(metas) == 1:
            return metas[0]
        return [metas[i] for i in self._set_of_layer]

    def _step_metadata(self, attn_metadata: object) -> list[CudaAttentionMetadata] | None:
        """The eager step's metadata per distinct (group, window), in attention_keys order;
        None unless each is a decode-only CudaAttentionMetadata."""
        if isinstance(attn_metadata, list) and len(self.attention_keys) > 1:
            metas = [attn_metadata[i] for i in self._first_layer_of_set]
        elif len(self.attention_keys) == 1:
            metas = [attn_metadata]
        else:
            return None
        for meta in metas:
            if not isinstance(meta, CudaAttentionMetadata) or not meta.is_decode_only:
                return None
        return metas

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per capture size, largest first, into one shared memory pool.

        The static buffers hold padding values throughout (slot -1: no cache write lands),
        so capturing never touches a live sequence's KV blocks.
        """
        if not self.enabled or self.graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            # Eager warm-up: compiles our NVRTC kernels and initialises cuBLAS workspaces
            # outside the capture.
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.capture_sizes,
            time.perf_counter() - start,
        )

    def graph_size_for(self, num_tokens: int) -> int | None:
        """The smallest captured batch size that holds num_tokens, if any."""
        return smallest_holding(self.capture_sizes, self.graphs, num_tokens)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: object
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] from a graph replay, or None: run the model eagerly.

        Replays only decode-only batches (CudaAttentionMetadata.is_decode_only) of at most
        the largest captured size whose contexts fit max_blocks_per_seq.
        """
        if not self.enabled or not self.graphs:
            return None
        metas = self._step_metadata(attn_metadata)
        n = input_ids.shape[0]
        size = self.graph_size_for(n)
        if (
            metas is None
            or size is None
            or any(m.block_tables.shape[1] > self.max_blocks_per_seq for m in metas)
            or any(m.max_decode_seq_len > self.max_seq_len for m in metas)
        ):
            return None

        # Real rows, then padding rows up to the graph's size (device-to-device copies).
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
        for meta, buffers in zip(metas, self.buffers, strict=True):
            buffers.fill(meta, n, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]


class _AttentionBuffers:
    """One (group, window)'s static attention inputs; padding rows write nowhere (slot -1)
    and attend to one slot of block 0."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_batch, max_blocks_per_seq), dtype=torch.int32, device=device
        )

    def fill(self, meta: CudaAttentionMetadata, n: int, size: int) -> None:
        """The step's n real rows, then padding up to the captured size."""
        width = meta.block_tables.shape[1]
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()
