"""This rank's KV cache, a memory owner sleep mode releases and restores.

    KVCache(layout, parallel)   sized (the smallest pool any rank can hold), allocated:
                                tensors   one per cache slot of the groups this stage uses
                                state     a hybrid model's recurrent-state slots
                                          (executor/kv/state_pool.py), None without
                                caches    one per layer of this stage (tensors, shared; a
                                          state layer's LayerState)
                                pool      the tensors as whole blocks (pool.py), a draft's too
                                proposer  speculative decoding's (a draft model's KV is part
                                          of every block)
                                tiers     the tiers below the pool (connector.py), sender
                                          a disaggregation producer's (transfer.py)
    release(level)              the tensors, the state and the proposer go (either level: the cache's
                                contents are gone, the core resets its prefix cache)
    restore()                   a fresh, empty pool of the same size
    restore_proposer()          the proposer made again (sleep mode: once the weights are
                                back too)

The tiers and the sender keep their own bytes through sleep: they read the pool's tensors
when they move a block, and the pool is handed the new ones.
"""

from __future__ import annotations

import logging

import torch

from zllm.config.engine import DEFAULT_CPU_KV_CACHE_BYTES
from zllm.config.quantization import CHECKPOINT_QUANTIZATIONS
from zllm.executor.host.layout import RankLayout
from zllm.executor.kv.connector import KVTiers
from zllm.executor.kv.gpu_memory import (
    StepShape,
    activation_reserve_bytes,
    dequantized_matrix_bytes,
    kv_pool_bytes,
    weight_bytes,
)
from zllm.executor.kv.pool import KVPool
from zllm.executor.kv.state_pool import LayerState, StatePool
from zllm.executor.kv.transfer import KVSender, transfer_layout
from zllm.executor.parallel.groups import ONE_RANK, Parallel
from zllm.executor.spec_decode.draft_model import DraftModelProposer
from zllm.executor.spec_decode.proposer import Proposer, make_proposer
from zllm.kv.kv_dtypes import row_bytes
from zllm.kv.state_layout import num_state_slots
from zllm.model.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """K and V for every attention layer: 2 x layers x kv_heads x head_dim x dtype size (a
    hybrid's state layers keep no K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(arch.attention_layers) * arch.num_kv_heads * arch.head_dim * elem


class KVCache:
    """The KV tensors, their pool, tiers and sender, and the proposer that shares the blocks."""

    def __init__(
        self, layout: RankLayout, parallel: Parallel = ONE_RANK, free_before_load: int = 0
    ) -> None:
        """`free_before_load`: a GPU's free bytes before the weights loaded (the load's share
        of --gpu-memory-utilization, executor/kv/gpu_memory.py)."""
        self.layout = layout
        config = layout.config
        self._free_before_load = free_before_load
        arch = layout.arch
        state_layers = [i for i in arch.state_layers if i in layout.layers]
        num_slots = num_state_slots(arch, config.scheduler.max_num_seqs)
        self.state = (
            StatePool(
                arch.state,
                state_layers,
                num_slots,
                num_slots if config.cache.enable_prefix_caching else 0,  # snapshots
                layout.device,
            )
            if arch.state is not None
            else None
        )
        # Ranks may see different free memory (GPUs), stages hold different layers: the pool
        # is the smallest any can hold.
        self.num_blocks = parallel.min_across(config.cache.num_blocks or self.profile_num_blocks())
        config.cache.num_blocks = self.num_blocks
        self.tensors: list[torch.Tensor] = []
        self.caches: list[torch.Tensor | LayerState | None] = []
        self.pool = KVPool([])
        self.restore()
        # Before the tiers: a draft model's KV is part of every block they hold.
        self.proposer: Proposer | None = None
        self.restore_proposer()
        # KV offload: the tiers below the pool; a disaggregation consumer's buffer of
        # received blocks is one too.
        offload, transfer = config.kv_offload, config.kv_transfer
        offloads = offload is not None and offload.enabled
        receives = transfer is not None and transfer.consumes
        # Each rank (every stage's tensor-parallel ranks) keeps and moves its part of a block.
        rank, ranks = parallel.rank, config.world_size
        self.tiers = KVTiers(config, self.pool, rank) if offloads or receives else None
        # A disaggregation producer's sender of prompt blocks.
        self.sender: KVSender | None = None
        if transfer is not None and transfer.produces:
            block_layout = transfer_layout(config, rank)
            self.sender = KVSender(transfer, self.pool, block_layout, rank, ranks)
        self._log()

    # ---- memory owner -------------------------------------------------------------------------
    def release(self, level: int) -> None:
        """Either level: the tensors and the proposer (a draft model: its weights beside its
        KV); the tiers below keep theirs."""
        del level  # (the same at both)
        self.tensors, self.caches = [], []
        if self.state is not None:
            self.state.release()
        self.pool.tensors, self.pool.draft = [], []
        self.proposer = None

    def restore(self) -> None:
        """A fresh, zeroed pool of num_blocks blocks (and of state slots)."""
        layout = self.layout
        heads, width = layout.arch.num_kv_heads, layout.kv_row_width
        shape = (2, self.num_blocks, layout.block_size, heads, width)
        # Layer i of every KV cache group uses tensor i (kv_cache_groups.py): group_size
        # tensors, or on a pipeline stage those its layers use.
        slots = sorted(set(layout.kv_slot_of.values()))
        by_slot = {
            slot: torch.zeros(shape, dtype=layout.kv_dtype, device=layout.device) for slot in slots
        }
        self.tensors = list(by_slot.values())
        if self.state is not None and not self.state.layers:
            self.state.restore()
        # One per layer of this stage, in order (layout.layers).
        self.caches = [
            by_slot[layout.kv_slot_of[layer]]
            if layer in layout.kv_slot_of
            else self._state_of(layer)
            for layer in layout.layers
        ]
        self.pool.tensors = self.tensors

    def restore_proposer(self) -> None:
        """Speculative decoding's proposer; a draft model's KV tensors join the pool's blocks
        (the tiers and transfers move them with the target's, under the same key)."""
        layout = self.layout
        self.proposer = make_proposer(layout.config, self.num_blocks, layout.dtype)
        draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        # Only the last pipeline stage runs the draft (it proposes after sampling): an
        # earlier stage's draft tensors are never written, so its tiers need not keep them.
        runs_draft = draft is not None and layout.pp.is_last
        self.pool.draft = draft.kv_caches if runs_draft else []

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block `src`'s bytes into `dst`, the draft model's too."""
        for kv in self.tensors:  # a block's bytes: its group's layers, one per tensor
            kv[:, dst].copy_(kv[:, src])
        if self.proposer is not None:
            self.proposer.copy_block(src, dst)

    # ---- sizing -------------------------------------------------------------------------------
    def profile_num_blocks(self) -> int:
        """The blocks the budget holds: --kv-cache-memory-bytes, on a GPU what its memory
        leaves (_gpu_budget), on CPU a default."""
        layout = self.layout
        budget = layout.config.cache.kv_cache_memory_bytes
        # A hybrid's state slots come out of the budget; a GPU's measured budget has them
        # counted already (allocated before it is measured).
        state_bytes = self._state_bytes()
        if budget is None:
            if layout.device.type == "cuda":
                budget, state_bytes = self._gpu_budget(), 0
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        per_block = self.bytes_per_slot() * layout.block_size
        num_blocks = (budget - state_bytes) // per_block
        if num_blocks < 1:
            state = f" after the recurrent state's {state_bytes} bytes" if state_bytes else ""
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} "
                f"bytes){state}."
            )
        return int(num_blocks)

    def _gpu_budget(self) -> int:
        """--gpu-memory-utilization of the device's memory, less the load and the largest
        step's activations, within what is free (executor/kv/gpu_memory.py)."""
        layout, config = self.layout, self.layout.config
        torch.cuda.empty_cache()  # (the load's freed fp32 copies are not ours to count)
        free, total = torch.cuda.mem_get_info(layout.device)
        step = StepShape(
            max_tokens=config.scheduler.max_num_batched_tokens,
            max_sampled_rows=config.scheduler.max_num_seqs,
            max_context=config.scheduler.max_model_len,
            dtype_bytes=layout.dtype.itemsize,
        )
        reserve = activation_reserve_bytes(layout.arch, step)
        if config.quantization in CHECKPOINT_QUANTIZATIONS:  # a prefill's dequantized matrix
            reserve += dequantized_matrix_bytes(layout.arch, layout.dtype.itemsize)
        if config.piecewise_cuda_graphs and not config.enforce_eager:  # captured after the pool
            from zllm.executor.graphs.piecewise import static_bytes

            reserve += static_bytes(layout.arch, step.max_tokens, layout.dtype.itemsize)
        draft = config.speculative.draft_arch if config.speculative is not None else None
        if draft is not None:  # (loaded after the pool)
            reserve += weight_bytes(draft, layout.dtype.itemsize)
        budget = kv_pool_bytes(
            total, self._free_before_load, free, reserve, config.cache.gpu_memory_utilization
        )
        logger.info("GPU memory: %s", budget.explanation)
        if budget.pool_bytes <= 0:
            raise ValueError(
                f"no GPU memory is left for the KV cache: {budget.explanation}. Raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs / "
                "--max-model-len, or free the GPU"
            )
        return budget.pool_bytes

    def bytes_per_slot(self) -> int:
        """The target's bytes per slot (this stage's layers'), plus a draft model's (it shares
        the block ids)."""
        layout = self.layout
        row = row_bytes(layout.arch.head_dim, layout.config.kv_dtype)
        draft = DraftModelProposer.kv_bytes_per_slot(layout.config, layout.dtype)
        # The cache tensors this stage allocates (every group's slots on one stage).
        num_tensors = len(set(layout.kv_slot_of.values()))
        return 2 * num_tensors * layout.arch.num_kv_heads * row + draft

    def _state_of(self, layer: int) -> LayerState | None:
        """A state layer's slots; None for a layer with neither K and V nor a state (an
        MLP-only layer)."""
        assert self.state is not None, f"layer {layer} has no KV cache group and no state"
        return self.state.layers.get(layer)

    def _state_bytes(self) -> int:
        """The recurrent-state slots' bytes, taken from the cache's budget (0: none)."""
        return 0 if self.state is None else self.state.total_bytes

    def _log(self) -> None:
        layout = self.layout
        per_slot = self.bytes_per_slot()
        groups = ", ".join(
            f"{len(g.layers)} layers "
            + (f"window {g.sliding_window}" if g.sliding_window else "full")
            for g in layout.kv_groups
        )
        state = ""
        if self.state is not None:
            state = (
                f"; state: {self.state.num_slots} slots of {self.state.bytes_per_slot} bytes "
                f"and {self.state.num_snapshots} prefix snapshots "
                f"({self._state_bytes() / 2**30:.2f} GiB, {len(self.state.layer_ids)} layers)"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%d bytes per slot, %.2f GiB); %d group(s): %s%s",
            self.num_blocks,
            layout.block_size,
            str(layout.kv_dtype).removeprefix("torch."),
            per_slot,
            self.num_blocks * layout.block_size * per_slot / 2**30,
            len(layout.kv_groups),
            groups,
            state,
        )
