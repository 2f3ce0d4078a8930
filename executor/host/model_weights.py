"""The model's weights on this rank, a memory owner sleep mode releases and restores.

    ModelWeights(layout)   the quantization method chosen, the model built and loaded (this
                           rank's heads, its stage's layers), batch-invariant and LoRA-wrapped
                           as configured
    release(level)         1: on a GPU to pinned host memory (on CPU they are there already,
                           so they stay); 2: dropped
    restore()              back onto the device, or loaded again from the model file

sleep_mode.py decides when; the decode path's fused CPU stack reads these weights and is
rebuilt by its own owner (decode_path.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from zllm.config.quantization import CHECKPOINT_QUANTIZATIONS
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels.batch_invariant import TILE_ROWS, tiled
from zllm.executor.kernels.gguf_arithmetic import GGUF_METHODS
from zllm.executor.layers.linear.dense import use_dense_rows_
from zllm.executor.layers.linear.gguf import gpu_layout_
from zllm.executor.layers.linear.tiled import make_batch_invariant
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.lora.manager import LoRAManager
from zllm.executor.models import model_class_of
from zllm.executor.models.transformers.encoder_matmuls import (
    onednn_available,
    pack_encoder_matmuls_,
)
from zllm.executor.parallel.shards import release_other_stages_ends
from zllm.executor.weights import blocks as weight_blocks
from zllm.executor.weights import quantization
from zllm.executor.weights.loader import init_dummy_weights, load_weights
from zllm.executor.weights.placement import move_blocks_, move_weights
from zllm.model.family import Trait
from zllm.model.gguf import read_gguf
from zllm.model.registry import code_family, family_of
from zllm.runtime.heap_trim import trim_heap

if TYPE_CHECKING:
    from zllm.executor.host.layout import RankLayout

logger = logging.getLogger(__name__)

# Methods whose kernel reads blocks (GGUF's, a 16-bit checkpoint's rows, a quantized
# checkpoint's repacked) in place of fp32.
_BLOCK_METHODS = (*GGUF_METHODS, quantization.SIXTEEN_BIT, *CHECKPOINT_QUANTIZATIONS)


class ModelWeights:
    """The model (None after sleep level 2), its quantization method and LoRA manager."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self.quantization = "none"
        self.model: nn.Module = None  # type: ignore[assignment]  # (load sets it)
        self.lora: LoRAManager | None = None
        self._on_host = False  # sleep level 1 on a GPU: in pinned host memory
        self.load()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32; in deterministic mode in fixed-size tiles."""
        if self.layout.config.deterministic:
            return tiled(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    # ---- memory owner -------------------------------------------------------------------------
    def release(self, level: int) -> None:
        """Level 1: to pinned host memory on a GPU (copied back at full bandwidth, no file
        read), kept on CPU (moving them would free nothing); level 2: dropped."""
        if level >= 2:
            self.model = None  # type: ignore[assignment]
            self.lora = None
        elif self.layout.device.type == "cuda":
            move_weights(self.model, torch.device("cpu"), pin=True)
            self._on_host = True

    def restore(self) -> None:
        """Back onto the device from host memory, or read from the model file after level 2."""
        if self.model is None:
            self.load()
        elif self._on_host:
            move_weights(self.model, self.layout.device)
            self._on_host = False

    # ---- loading ------------------------------------------------------------------------------
    def load(self) -> None:
        """The model, quantized, made batch-invariant and LoRA-wrapped as configured."""
        layout, config = self.layout, self.layout.config
        self.quantization = self._quantization_method()
        self.model = self._load_model()
        if self._transformers_code:
            # Its stage was cut at load (models/transformers/pp.py): other stages' layers, ends.
            ends_released = layout.pp.enabled
        else:
            ends_released = release_other_stages_ends(self.model, layout.pp)
        if config.model_path.endswith(".gguf"):
            read_gguf(config.model_path).release_pages()  # copied out: the model holds them
        if self.quantization in _BLOCK_METHODS or ends_released:
            # The fp32 weights the blocks replaced, another stage's embedding / logits (and
            # on the transformers backend the other stages' layers, loaded with the model).
            release_freed_memory(layout.device)
        self._use_dense_rows()
        self._pack_encoder_matmuls()
        if config.deterministic:
            wrapped = make_batch_invariant(self.model)
            logger.info("Deterministic mode: %d matmuls in %d-row tiles", wrapped, TILE_ROWS)
        # Where steps replay CUDA graphs, adapters sit in fixed slot buffers (lora/slots.py);
        # --deterministic keeps the tiled segmented updates, so LoRA steps run eagerly there.
        self.lora = None
        if config.lora is not None:
            slots = not (config.enforce_eager or config.deterministic) and layout.graphs_run_here()
            self.lora = LoRAManager(
                self.model, config, layout.dtype, layout.device, layout.tp, slots=slots
            )

    def _pack_encoder_matmuls(self) -> None:
        """An fp32 encoder on CPU (the transformers backend's BERT family): its matmuls
        through oneDNN with bias and GELU fused (models/transformers/encoder_matmuls.py), where nothing
        else wraps or cuts them."""
        layout, config, model = self.layout, self.layout.config, self.model
        plain = not (layout.tp.enabled or layout.pp.enabled or config.deterministic)
        if not (
            self._transformers_code
            and family_of(config.arch).has(Trait.ENCODER)
            and layout.device.type == "cpu"
            and layout.dtype == torch.float32
            and self.quantization == "none"
            and config.lora is None
            and plain
            and onednn_available()
        ):
            return
        packed = pack_encoder_matmuls_(model.base)
        logger.info("%d encoder matmuls through oneDNN, bias and GELU fused", packed)

    def _use_dense_rows(self) -> None:
        """fp32 matmuls on CPU: decode-sized calls through csrc/cpu/dense_rows.h (zllm's own
        models; the transformers backend keeps transformers' modules)."""
        layout = self.layout
        fp32_cpu = layout.device.type == "cpu" and layout.dtype == torch.float32
        if not fp32_cpu or not cpu_kernels.enabled():
            return
        if self._transformers_code:
            return
        try:
            swapped = use_dense_rows_(self.model)
        except cpu_kernels.CpuKernelError as exc:
            logger.info("fp32 matmuls stay torch's at every size: %s", exc)
            return
        if swapped:
            logger.info("%d fp32 matmuls take the few-rows kernel at 1-8 rows", swapped)

    @property
    def _transformers_code(self) -> bool:
        """Whether transformers' modeling code runs the model (the family's code, or a native
        family's under --model-impl transformers: zllm/model/impl.py)."""
        config = self.layout.config
        return code_family(config.arch, config.model_impl).code == "transformers"

    def _load_model(self) -> nn.Module:
        """Our model code, or transformers' through the transformers backend (model_impl)."""
        layout, config = self.layout, self.layout.config
        dummy = config.load_format == "dummy"
        if self._transformers_code:
            # The whole model's arch: each rank cuts its part of the loaded model (tp, pp).
            where = (layout.dtype, layout.device, layout.attention)
            # (Quantized: transformers' matmuls swapped for ours after loading.)
            return model_class_of(config.arch, config.model_impl).load(
                config.model_path, config.arch, *where, dummy, layout.tp, layout.pp,
                self.quantization,
            )  # fmt: skip
        model_cls = model_class_of(layout.arch, config.model_impl)
        model = model_cls(
            config.arch, dtype=layout.dtype, attention=layout.attention, tp=layout.tp, pp=layout.pp
        )
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.keep_positions(config.scheduler.max_model_len)
        if dummy:
            init_dummy_weights(model, config.seed)
            if self.quantization != "none":
                quantization.quantize_model_(model, self.quantization, config.model_path)
            return model.to(layout.device).eval()
        # GGUF blocks (or a 16-bit checkpoint's rows) serve the matrices the kernel reads:
        # those are never widened to fp32.
        plan = None
        if self.quantization in _BLOCK_METHODS:
            on_cpu = layout.device.type == "cpu"
            plan = weight_blocks.BlockPlan(model, config.model_path, self.quantization, on_cpu)
        served = plan.served if plan is not None else frozenset()
        # (A pipeline stage reads only its own layers' weights.)
        layers = getattr(model, "layer_indices", None)
        weights = load_weights(config.model_path, config.arch, layers, skip=served)
        model.load_weights(weights, served=served)
        if plan is not None:
            plan.apply(model, config.model_path)
        elif self.quantization != "none":
            quantization.quantize_model_(model, self.quantization, config.model_path)
        model.to(layout.device)
        if plan is not None and layout.device.type == "cuda":  # the blocks too (cuda_blocks.py)
            gpu_layout_(model, layout.dtype)
            move_blocks_(model, layout.device)
        return model.eval()

    def _quantization_method(self) -> str:
        """config.quantization, checked against the model (or one picked when unset)."""
        layout, config = self.layout, self.layout.config
        method = config.quantization
        if method is None:
            method = "none"
            if config.load_format == "dummy":
                return method  # random fp32 weights: no blocks to read
            on_cpu_fp32 = layout.device.type == "cpu" and layout.dtype == torch.float32
            if on_cpu_fp32 and cpu_kernels.enabled():
                reason = weight_blocks.gguf_kernel_plan(config.model_path)
                if reason is None:
                    # The fastest arithmetic per type on this CPU (gguf_arithmetic.py);
                    # --deterministic needs a row's result not to depend on the call's size.
                    method = "gguf-float" if config.deterministic else "gguf"
                elif config.model_path.endswith(".gguf"):
                    logger.info("GGUF kernels not used, fp32 matmuls: %s", reason)
                elif quantization.sixteen_bit_checkpoint(config.model_path):
                    method = quantization.SIXTEEN_BIT
        if method == "none":
            return method
        explicit = config.quantization is not None  # asked for: refuse what it can't serve
        if explicit:
            quantization.check_quantization(method, config.model_path, strict=True)
        if method in _BLOCK_METHODS and layout.device.type == "cpu":
            try:
                cpu_kernels.load()  # built (or loaded) now: a failure surfaces here, once
            except cpu_kernels.CpuKernelError as exc:
                if explicit:
                    raise
                logger.warning("GGUF kernels unavailable, using fp32 matmuls: %s", exc)
                return "none"
        return method


def release_freed_memory(device: torch.device) -> None:
    """Hand memory freed by dropped tensors back to the system: collect cycles, then on a GPU
    empty torch's cache; on CPU ask glibc to return free heap pages (tensors below its mmap
    threshold live in the heap, which free() alone does not shrink: runtime/heap_trim.py). The
    load calls it for the fp32 copies its blocks replaced, sleep mode after its owners released
    theirs."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    trim_heap()
