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

import torch

from zllm.executor.attention_cuda import CudaAttentionMetadata
from zllm.executor.cuda_kernels import DecodeWorkspace, plan_decode

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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
    ) -> None:
        """`enabled=False` (--enforce-eager) makes run() always answer None."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_blocks_per_seq * block_size
        self.device = torch.device(device) if device is not None else kv_caches[0].device
        self.enabled = enabled and self.device.type == "cuda"
        # A batch never exceeds max_num_seqs: capture the sizes below it and the first one
        # that holds it, none bigger.
        sizes = sorted(set(capture_sizes))
        holding = [s for s in sizes if s >= max_num_seqs]
        self.capture_sizes = [s for s in sizes if s < max_num_seqs] + holding[:1]
        self.max_batch = self.capture_sizes[-1] if self.capture_sizes else 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
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

    def _metadata(self, size: int) -> CudaAttentionMetadata:
        return CudaAttentionMetadata.for_decode(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            block_size=self.block_size,
            max_seq_len=self.max_seq_len,
            workspace=self.workspace,
        )

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
        for size in self.capture_sizes:
            if size >= num_tokens and size in self.graphs:
                return size
        return None

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
        meta = attn_metadata
        if not isinstance(meta, CudaAttentionMetadata) or not meta.is_decode_only:
            return None
        n = input_ids.shape[0]
        size = self.graph_size_for(n)
        width = meta.block_tables.shape[1]
        if (
            size is None
            or width > self.max_blocks_per_seq
            or meta.max_decode_seq_len > self.max_seq_len
        ):
            return None

        # Real rows, then padding rows up to the graph's size (device-to-device copies).
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
