"""Which attention serves the model: chosen once, before the model is built, and passed in.

An `AttentionBackend` says how to make one layer's attention and how to build the step's
attention metadata that those layers read; the model builds its layers with the first, the
model runner builds each step's metadata with the second. Nothing is swapped afterwards.

    backend       layer                                      metadata               when
    torch         PagedAttention: gather + SDPA              AttentionMetadata      the reference;
                                                                                    the fallback
    cpu-kernels   PagedAttention, decode from csrc/cpu       AttentionMetadata      CPU fp32 when
                  (prefill still SDPA)                                              the kernels build
    cuda          CudaPagedAttention: csrc/*.cu + SDPA       CudaAttentionMetadata  a CUDA device
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import torch

from zllm.executor.attention.paged import AttentionMetadata, PagedAttention
from zllm.executor.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from zllm.executor.attention.cuda import CudaAttentionMetadata

logger = logging.getLogger(__name__)

# What a step's forward carries to every layer: the metadata of the backend in use.
StepAttentionMetadata: TypeAlias = "AttentionMetadata | CudaAttentionMetadata"


class AttentionLayer(Protocol):
    """One layer's attention: writes the new K/V into its cache, attends through it."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
        kv_written: bool = False,  # the model wrote key and value already (one fused kernel)
        sinks: torch.Tensor | None = None,  # fp32 [heads]: attention sink logits (gpt-oss)
    ) -> torch.Tensor: ...


class BuildMetadata(Protocol):
    """AttentionMetadata.build's signature (see executor/attention/paged.py)."""

    def __call__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | np.ndarray,
        block_size: int,
        device: torch.device | str,
        sliding_window: int | None = None,
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One way to attend: the layers the model is built with and the metadata they read."""

    name: str
    description: str  # for the log line saying which backend serves the model
    # (num_heads, num_kv_heads, head_dim, scale=None) -> one layer's attention; the scale
    # defaults to head_dim ** -0.5.
    make_layer: Callable[..., AttentionLayer]
    build_metadata: BuildMetadata


def metadata_per_layer(
    attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata], num_layers: int
) -> Sequence[StepAttentionMetadata]:
    """What a model's forward receives, as one metadata per layer.

    The model runner passes a list, one entry per layer (layers of a KV cache group share a
    block table; sliding-window layers see a window-limited view); a single metadata serves
    every layer (tests and the CUDA graph runner pass one).
    """
    if isinstance(attn_metadata, Sequence):
        if len(attn_metadata) != num_layers:
            raise ValueError(f"got {len(attn_metadata)} attention metadata for {num_layers} layers")
        return attn_metadata
    return [attn_metadata] * num_layers


TORCH_ATTENTION = AttentionBackend(
    name="torch",
    description="SDPA; decode gathers each context from the cache first",
    make_layer=PagedAttention,
    build_metadata=AttentionMetadata.build,
)
CPU_KERNEL_ATTENTION = AttentionBackend(
    name="cpu-kernels",
    description="decode read in place by csrc/cpu/paged_attention.h; prefill in SDPA",
    make_layer=functools.partial(PagedAttention, decode_kernel=cpu_kernels.paged_decode_attention),
    build_metadata=AttentionMetadata.build,
)


def choose_attention_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """Our CUDA kernels on a GPU (torch for head sizes they have no variant of); on CPU in
    fp32 the csrc/cpu decode kernel when it builds (not with ZLLM_CPU_KERNELS=0, nor for a
    head_dim that is not a multiple of 8); else torch. Both kernels serve full and
    sliding-window layers alike (they window the rows themselves)."""
    if device.type == "cuda":
        from zllm.executor.kernels.cuda import SUPPORTED_HEAD_DIMS

        if head_dim not in SUPPORTED_HEAD_DIMS:
            logger.warning(
                "head_dim %d: CUDA attention kernels not used (they serve %s); torch SDPA",
                head_dim,
                SUPPORTED_HEAD_DIMS,
            )
            return TORCH_ATTENTION
        from zllm.executor.attention.cuda import CUDA_ATTENTION
        from zllm.executor.attention.cuda_prefill import prefill_mode

        prefill_mode()  # a bad ZLLM_CUDA_PREFILL stops the engine at start, not at a prefill
        return CUDA_ATTENTION
    if device.type != "cpu" or dtype != torch.float32:
        return TORCH_ATTENTION
    if not cpu_kernels.enabled() or head_dim % 8 != 0:
        return TORCH_ATTENTION
    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelError as exc:
        logger.warning("CPU kernels unavailable, decode attention stays in torch: %s", exc)
        return TORCH_ATTENTION
    return CPU_KERNEL_ATTENTION
