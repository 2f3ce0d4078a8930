"""What this rank holds of the model: the layout its weights, KV cache and decode path share.

    arch, layers       this rank's share of the heads (tensor parallel), its stage's layers
    kv_groups          the KV cache groups (zllm/kv/cache_groups.py); per layer of the stage,
                       layer_attention (block tables, window) and kv_slot_of (cache tensor)
    device, dtypes     where the weights (dtype) and the KV pool (kv_dtype) live
    attention          the attention backend the model is built with

Decided once, from the config and this rank's place (executor/parallel/), before anything is
loaded; the model host's parts (model_host.py) read it and never change it, so it outlives
sleep. Which KV group and window each layer reads is the attention's own record
(executor/attention/layer_groups.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zllm.config.engine import EngineConfig
from zllm.executor.attention.backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    choose_attention_backend,
)
from zllm.executor.attention.layer_groups import LayerAttention, layer_attention, layer_kv_slots
from zllm.executor.kernels import cuda_moe
from zllm.executor.parallel.groups import ONE_RANK, Parallel, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import local_arch
from zllm.kv.cache_groups import KVCacheGroup, kv_cache_groups
from zllm.kv.kv_dtypes import row_width
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Feature, Trait
from zllm.model.registry import code_family, family_of

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}


@dataclass(frozen=True, slots=True)
class RankLayout:
    """This rank's arch, layers, KV groups, device, dtypes and attention backend."""

    config: EngineConfig
    tp: TensorParallel
    pp: PipelineParallel
    arch: ModelArchConfig  # this rank's share of the heads (local_arch)
    layers: range  # the layers this stage holds
    device: torch.device
    dtype: torch.dtype
    # What the KV pool stores (--kv-cache-dtype; zllm/kv/kv_dtypes.py: an int8 row carries
    # its scale in row_width's last bytes).
    kv_dtype: torch.dtype
    kv_row_width: int
    block_size: int
    kv_groups: list[KVCacheGroup]
    layer_attention: list[LayerAttention]  # one per layer of this stage
    kv_slot_of: dict[int, int]  # layer -> its cache tensor (every one of them on one stage)
    attention: AttentionBackend
    # Whether an image's tokens see their whole image (the family's BIDIRECTIONAL_IMAGES, for a
    # model that takes images): the attention metadata then carries each step's image spans.
    whole_images: bool

    @classmethod
    def of(cls, config: EngineConfig, parallel: Parallel = ONE_RANK) -> RankLayout:
        """`parallel`: this process's place among the executor's ranks."""
        tp, pp = parallel.tp, parallel.pp
        arch = local_arch(config.arch, tp)
        layers = pp.layer_range(arch.num_layers)
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current one
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = _DTYPES[config.dtype]
        kv_groups = kv_cache_groups(arch, config.cache.hybrid_kv_cache)
        family = family_of(arch)
        # MLA attends by executor/attention/mla.py over the torch backend's metadata; image
        # tokens that see their whole image (Gemma 3's) do so through masks only that
        # metadata carries (on CPU the CPU-kernel backend's is the same metadata). Causal
        # image tokens (Qwen2.5-VL's, LLaVA's) take the CUDA kernels like text.
        whole_images = arch.vision and family.has(Trait.BIDIRECTIONAL_IMAGES)
        torch_masks = family.has(Trait.MLA) or (whole_images and device.type != "cpu")
        return cls(
            config=config,
            tp=tp,
            pp=pp,
            arch=arch,
            layers=layers,
            device=device,
            dtype=dtype,
            kv_dtype=_KV_DTYPES[config.kv_dtype],
            kv_row_width=row_width(arch.head_dim, config.kv_dtype),
            block_size=config.cache.block_size,
            kv_groups=kv_groups,
            layer_attention=layer_attention(arch, kv_groups, layers),
            kv_slot_of=layer_kv_slots(kv_groups, layers),
            attention=TORCH_ATTENTION
            if torch_masks
            else choose_attention_backend(device, dtype, arch.head_dim),
            whole_images=whole_images,
        )

    def graphs_run_here(self) -> bool:
        """Whether this device, attention backend and model could replay CUDA graphs (the
        decode path captures them; LoRA then keeps its adapters in slot buffers)."""
        if self.device.type != "cuda" or self.attention.name != "cuda":
            return False  # graphs replay the CUDA backend's kernels
        family = code_family(self.arch, self.config.model_impl)
        if not family.supports(Feature.CUDA_GRAPHS):
            logger.info("%s: no CUDA graphs (%s)", family.title, family.lacks[Feature.CUDA_GRAPHS])
            return False
        if family.has(Trait.MOE) and (self.config.deterministic or not cuda_moe.ENABLED):
            # The per-expert path (ZLLM_CUDA_MOE=0, and --deterministic's tiles) reads each
            # expert's token count on the host (layers/moe/); the expert kernel
            # (kernels/cuda_moe.py) groups the tokens on the device.
            logger.info("Mixture-of-experts layers on the per-expert path: no CUDA graphs")
            return False
        if self.tp.enabled or self.pp.enabled:
            # Capturing NCCL collectives (and the communicator's lazy setup) is not tried yet.
            logger.info("Tensor or pipeline parallel: no CUDA graphs")
            return False
        return True
