"""LoRAManager: the model's matmuls wrapped once, adapters loaded as requests name them.

Adapters are loaded in the executor the first time a request with them arrives
(NewRequestData.lora carries name, id and path) and kept while any live request uses them;
up to max_loras more stay loaded after their last request, least recently used evicted
first, so a returning adapter is not read again. The frontend (or `LLM`) has already checked
the files (zllm.lora.read_adapter), so loading here only reads tensors known to fit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from zllm.config.engine import EngineConfig, LoRAConfig
from zllm.executor.layers.linear.parallel import RowParallelLinear
from zllm.executor.lora.layers import LoRABatch, LoRALinear
from zllm.executor.lora.slots import LoRASlots, rows_by_slot
from zllm.executor.lora.weights import (
    ATTENTION_MATMULS,
    FUSED_MATMULS,
    LATENT_MATMULS,
    UNFUSED_MATMULS,
    AdapterWeights,
    load_adapter_weights,
)
from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.lora import LoRARequest, read_adapter
from zllm.protocol import CacheSize

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        engine: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel = SINGLE,
        *,
        slots: bool = False,
    ) -> None:
        """Adapters are checked and cut against the whole model (`engine.arch`); `tp`: this
        rank's place, whose part of each update it keeps (weights.py). `slots`: updates from
        fixed buffers of max_loras slots (slots.py), so CUDA graphs can replay LoRA steps."""
        assert engine.lora is not None
        self.config: LoRAConfig = engine.lora
        self.arch = engine.arch
        self.tp = tp
        # The decoder layers, by their index in the whole model (a pipeline stage holds some),
        # and the matmuls adapters update: zllm's fused ones, or transformers' one per PEFT
        # module (the transformers backend: its decoder stack is model.base).
        transformers_model = hasattr(model, "hf")
        decoder = model.base.layers if transformers_model else model.layers
        self.layers = getattr(model, "layer_indices", range(len(decoder)))
        if transformers_model:
            self.matmuls = UNFUSED_MATMULS
        else:
            self.matmuls = LATENT_MATMULS if self.arch.mla is not None else FUSED_MATMULS
        self.dtype = dtype
        self.device = device
        self.batch = LoRABatch(tiled=engine.deterministic)
        self.adapters: OrderedDict[int, AdapterWeights] = OrderedDict()
        wrapped = self._wrap(decoder)
        self.slots = self._make_slots(wrapped, engine) if slots else None
        self.batch.slots = self.slots

    def _wrap(self, decoder: nn.ModuleList) -> list[LoRALinear]:
        """Every decoder matmul an adapter may target becomes a LoRALinear around it (after
        quantization, so the base stays whatever kernel serves it)."""
        wrapped: list[LoRALinear] = []
        for i, layer in zip(self.layers, decoder, strict=True):
            for name in self.matmuls:
                block = getattr(layer, "self_attn" if name in ATTENTION_MATMULS else "mlp", None)
                owner, attr = block, name
                if isinstance(getattr(block, name, None), RowParallelLinear):
                    # A row-parallel transformers matmul: the update joins the rank's partial
                    # product before the all-reduce sums it (and before the bias, added once).
                    owner, attr = getattr(block, name), "local"
                base = getattr(owner, attr, None)
                if isinstance(base, nn.Module):
                    wrapped.append(LoRALinear(base, self.batch, i, name))
                    setattr(owner, attr, wrapped[-1])
        if not wrapped:
            raise ValueError(
                "LoRA: this model's decoder layers have none of the matmuls adapters target "
                f"(self_attn / mlp .{', .'.join(self.matmuls)})"
            )
        return wrapped

    def _make_slots(self, wrapped: list[LoRALinear], engine: EngineConfig) -> LoRASlots:
        """Slot buffers for every wrapped matmul: its base's shape, and room for the widest
        update an adapter may bring there (max_lora_rank for each PEFT module it fuses)."""
        shapes = {}
        for linear in wrapped:
            base = linear.base
            out_features = getattr(base, "out_features", None) or base.weight.shape[0]
            width = self.config.max_lora_rank * len(self.matmuls[linear.key[1]])
            shapes[linear.key] = (base.in_features, out_features, width)
        slots = LoRASlots(
            shapes,
            num_slots=self.config.max_loras,
            # Every graph's rows: piecewise steps up to the token budget, decode graphs up to
            # max_num_seqs rows.
            max_tokens=max(engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs),
            dtype=self.dtype,
            device=self.device,
        )
        logger.info(
            "LoRA: %d slots in fixed buffers (%.1f MiB), so CUDA graphs replay LoRA steps",
            slots.num_slots,
            slots.bytes() / 2**20,
        )
        return slots

    def add(self, lora: LoRARequest) -> None:
        """Make sure the adapter is loaded (and mark it recently used)."""
        if lora.lora_int_id in self.adapters:
            self.adapters.move_to_end(lora.lora_int_id)
            return
        adapter = read_adapter(lora.lora_path, self.arch, self.config.max_lora_rank)
        self.adapters[lora.lora_int_id] = load_adapter_weights(
            adapter, self.arch, self.dtype, self.device, self.tp, self.layers, self.matmuls
        )
        logger.info(
            "LoRA adapter %s (id %d, rank %d) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            adapter.rank,
            lora.lora_path,
        )

    def evict(self, live: Iterable[int]) -> None:
        """Drop the least recently used adapters no live request uses, keeping max_loras."""
        in_use = set(live)
        idle = [i for i in self.adapters if i not in in_use]
        for lora_id in idle[: max(0, len(idle) - self.config.max_loras)]:
            del self.adapters[lora_id]
            if self.slots is not None:
                self.slots.forget(lora_id)

    def cache_size(self, live: Iterable[int]) -> CacheSize:
        """For /metrics: the adapters loaded, at most max_loras beside those `live` requests
        use (`evict` keeps that bound)."""
        num_live = len({i for i in live if i in self.adapters})
        bound = self.config.max_loras + num_live
        return CacheSize("executor", "lora_weights", len(self.adapters), bound)

    def set_batch(self, lora_ids: Sequence[int | None], query_lens: Sequence[int]) -> None:
        """This step's rows by adapter: request i has query_lens[i] rows, in batch order, and
        the model runner has put each adapter's requests side by side."""
        if self.slots is not None:
            step = {i for i in lora_ids if i is not None}
            slot_of = [
                -1 if i is None else self.slots.place(i, self.adapters[i], step) for i in lora_ids
            ]
            self.slots.set_rows(rows_by_slot(slot_of, query_lens))
            return
        spans: dict[int, tuple[int, int]] = {}
        start = 0
        for lora_id, num in zip(lora_ids, query_lens, strict=True):
            if lora_id is not None:
                first, end = spans.get(lora_id, (start, start))
                assert end == start, "an adapter's rows must be contiguous"
                spans[lora_id] = (first, start + num)
            start += num
        self.batch.groups = [
            (self.adapters[lora_id], slice(first, end)) for lora_id, (first, end) in spans.items()
        ]
